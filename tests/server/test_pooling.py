"""The pooling APIs through admission: embeddings (the real openai SDK as the client), score and
rerank (vLLM's bodies, with images of documents), to stand-ins that answer as vLLM does."""

from __future__ import annotations

from typing import Any

import aiohttp
import openai
import pytest

from tests.conftest import Upstream, error_body, routing

pytestmark = pytest.mark.timeout(60)
PNG = "data:image/png;base64,iVBORw0KGgo="
IMAGE = {"type": "image_url", "image_url": {"url": PNG}}


def table(text: Upstream, vision: Upstream) -> str:
    return routing(
        f"  - {{name: bge, upstreams: [{text.url}], accepts: [text], apis: [embeddings, score, rerank]}}",
        f"  - {{name: vlm2vec, upstreams: [{vision.url}], accepts: [text, image], apis: [embeddings, score, rerank]}}",
        f"  - {{name: chatty, upstreams: [{text.url}], accepts: [text]}}",
        f"  - {{name: sg-text, upstreams: [{text.url}], engine: sglang, accepts: [text], apis: [embeddings, rerank]}}",
        f"  - {{name: sg-vision, upstreams: [{vision.url}], engine: sglang, accepts: [text, image], "
        "apis: [embeddings, rerank]}",
    )


@pytest.fixture
async def both(upstream_factory) -> tuple[Upstream, Upstream]:
    return await upstream_factory("text"), await upstream_factory("vision")


async def post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as resp:
        return resp.status, await resp.json()


async def test_embeddings_of_text_and_of_images_are_admitted_by_the_table(gateway_factory, both) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    async with gw.client() as client:
        reply = await client.embeddings.create(model="bge", input=["a", "b"])
        assert len(reply.data) == 2 and reply.data[0].embedding == [0.5, -0.25, 0.125]
        messages = [{"role": "user", "content": [{"type": "text", "text": "a cat"}, IMAGE]}]
        with pytest.raises(openai.BadRequestError) as caught:  # vLLM's chat-style embedding request
            await client.embeddings.create(model="bge", input="", extra_body={"messages": messages})
        assert error_body(caught.value)["param"] == "messages[0].content[1]"
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="chatty", input="a")
        assert error_body(caught.value)["code"] == "unsupported_api"
        await client.embeddings.create(model="vlm2vec", input="", extra_body={"messages": messages})
    assert vision.received[-1].json()["messages"] == messages
    # SGLang's items: each carries every modality it has
    status, body = await post(f"{gw.url}/v1/embeddings", {"model": "sg-text", "input": [{"text": "t", "image": PNG}]})
    assert status == 400 and body["error"]["param"] == "input[0]" and "'text+image'" in body["error"]["message"]
    assert [r.path for r in text.received] == ["/v1/embeddings"]  # the refused ones reached no engine


@pytest.mark.parametrize("path", ["/v1/score", "/score"])
async def test_score_documents_with_images_are_classified(gateway_factory, both, path: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    body = {"model": "bge", "text_1": "slm markdown", "text_2": {"content": [IMAGE, IMAGE]}}
    status, answer = await post(gw.url + path, body)
    assert status == 400 and answer["error"]["param"] == "text_2.content[0]"
    assert answer["error"]["code"] == "unsupported_modality"
    status, answer = await post(gw.url + path, {**body, "model": "vlm2vec"})
    assert status == 200 and answer["data"][0]["object"] == "score"
    assert vision.received[-1].path == path and vision.received[-1].json()["text_2"] == body["text_2"]
    status, answer = await post(gw.url + path, {"model": "bge", "text_1": ["a", "b"], "text_2": ["c", "d"]})
    assert status == 200


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
async def test_rerank_documents_with_images_are_classified(gateway_factory, both, path: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    body = {"model": "bge", "query": "a cat", "documents": [{"content": [{"type": "text", "text": "x"}, IMAGE]}]}
    status, answer = await post(gw.url + path, body)
    assert status == 400 and answer["error"]["param"] == "documents[0].content[1]"
    status, answer = await post(gw.url + path, {**body, "model": "vlm2vec"})
    assert status == 200 and answer["results"][0]["relevance_score"] == 0.5
    status, answer = await post(gw.url + path, {"model": "bge", "query": "q", "documents": ["a", 5]})
    assert status == 400 and answer["error"]["param"] == "documents[1]"
    assert text.received == []


@pytest.mark.parametrize("path", ["/score", "/rerank", "/v2/rerank", "/v1/embeddings"])
async def test_the_routes_outside_v1_need_a_key_too(gateway_factory, both, monkeypatch, path: str) -> None:
    text, vision = both
    monkeypatch.setenv("POOLING_TEST_KEY", "sk-right")
    gw = await gateway_factory(
        table(text, vision).replace("models:", "auth:\n  keys:\n    - {name: t, key_env: POOLING_TEST_KEY}\nmodels:")
    )
    body = {"model": "bge", "input": "a", "text_1": "a", "text_2": "b", "query": "q", "documents": ["d"]}
    async with aiohttp.ClientSession() as session:
        async with session.post(gw.url + path, json=body) as resp:
            assert resp.status == 401 and (await resp.json())["error"]["code"] == "invalid_api_key"
        async with session.post(gw.url + path, json=body, headers={"Authorization": "Bearer sk-right"}) as resp:
            assert resp.status == 200
    assert len(text.received) == 1 and "Authorization" not in text.received[0].headers


# Every shape vLLM 0.33's pooling request models accept that carries content (issue 38): each one
# classified, its image refused for a text model at the part, admitted for a vision one.
SCORE_PAIRS = [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")]


@pytest.mark.parametrize(("first", "second"), SCORE_PAIRS)
async def test_every_pair_of_score_names_is_classified(gateway_factory, both, first: str, second: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    body: dict[str, Any] = {
        "model": "bge",
        first: "a cat",
        second: [{"content": [{"type": "text", "text": "x"}, IMAGE]}],
    }
    status, answer = await post(f"{gw.url}/v1/score", body)
    assert status == 400 and answer["error"]["code"] == "unsupported_modality"
    assert answer["error"]["param"] == f"{second}[0].content[1]"
    body = {"model": "bge", first: {"content": [IMAGE]}, second: "a document"}
    status, answer = await post(f"{gw.url}/v1/score", body)
    assert status == 400 and answer["error"]["param"] == f"{first}.content[0]"
    status, answer = await post(f"{gw.url}/v1/score", {**body, "model": "vlm2vec"})
    assert status == 200 and vision.received[-1].json()[first] == body[first]
    assert text.received == []


CONVERSATION = [{"role": "user", "content": [{"type": "text", "text": "a cat"}, IMAGE]}]
TEXT_TURN = [{"role": "user", "content": "a dog"}]
EMBEDDING_SHAPES: dict[str, tuple[dict[str, Any], str]] = {
    "one conversation in input": ({"input": CONVERSATION}, "input[0].content[1]"),
    "conversations in input": ({"input": [TEXT_TURN, CONVERSATION]}, "input[1][0].content[1]"),
    "conversations in messages": ({"messages": [TEXT_TURN, CONVERSATION]}, "messages[1][0].content[1]"),
    "one conversation in messages": ({"messages": CONVERSATION}, "messages[0].content[1]"),
}


@pytest.mark.parametrize("shape", list(EMBEDDING_SHAPES))
async def test_every_conversation_shape_of_embeddings_is_classified(gateway_factory, both, shape: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    fields, param = EMBEDDING_SHAPES[shape]
    status, answer = await post(f"{gw.url}/v1/embeddings", {"model": "bge", **fields})
    assert status == 400 and answer["error"]["code"] == "unsupported_modality", answer
    assert answer["error"]["param"] == param
    status, answer = await post(f"{gw.url}/v1/embeddings", {"model": "vlm2vec", **fields})
    assert status == 200, answer
    assert {k: vision.received[-1].json()[k] for k in fields} == fields  # sent as it came
    assert text.received == []


@pytest.mark.parametrize(
    ("value", "param"),
    [
        ([TEXT_TURN[0], {"text": "t"}], "input"),  # a message beside an SGLang item
        (["text", {"role": "user", "content": "x"}], "input"),  # a string beside a message
        ([TEXT_TURN, [{"content": "no role"}]], "input[1][0].role"),
        ([TEXT_TURN, []], "input[1]"),
    ],
)
async def test_an_input_of_mixed_kinds_is_refused_naming_it(gateway_factory, both, value: Any, param: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    status, answer = await post(f"{gw.url}/v1/embeddings", {"model": "vlm2vec", "input": value})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert vision.received == []


async def test_text_and_token_inputs_still_carry_no_parts(gateway_factory, both) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    for value in ["a", ["a", "b"], [1, 2, 3], [[1, 2], [3]], [[]]]:
        status, answer = await post(f"{gw.url}/v1/embeddings", {"model": "bge", "input": value})
        assert status == 200, (value, answer)
    assert len(text.received) == 5


# SGLang 0.5.23's shapes (V1RerankReqInput, ScoringRequest, EmbeddingRequest): parts in lists
SGLANG_SIDES: dict[str, tuple[dict[str, Any], str]] = {
    "a query of parts": ({"query": [{"type": "text", "text": "q"}, IMAGE], "documents": ["a"]}, "query[1]"),
    "documents of parts": (
        {"query": "q", "documents": ["a", [{"type": "text", "text": "d"}, IMAGE]]},
        "documents[1][1]",
    ),
}


@pytest.mark.parametrize("shape", list(SGLANG_SIDES))
async def test_sglangs_rerank_parts_are_classified(gateway_factory, both, shape: str) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    fields, param = SGLANG_SIDES[shape]
    status, answer = await post(f"{gw.url}/v1/rerank", {"model": "sg-text", **fields})
    assert status == 400 and answer["error"]["code"] == "unsupported_modality" and answer["error"]["param"] == param
    status, answer = await post(f"{gw.url}/v1/rerank", {"model": "sg-vision", **fields})
    assert status == 200 and text.received == []


async def test_a_stripped_document_of_parts_leaves_the_body_without_its_image(
    gateway_factory, upstream_factory
) -> None:
    engine = await upstream_factory("sglang")
    gw = await gateway_factory(
        routing(
            f"  - {{name: r, upstreams: [{engine.url}], engine: sglang, accepts: [text], apis: [rerank], "
            "on_unsupported: {image: strip}}"
        )
    )
    body = {"model": "r", "query": "q", "documents": ["a", [{"type": "text", "text": "d"}, IMAGE]]}
    status, _ = await post(f"{gw.url}/v1/rerank", body)
    assert status == 200
    assert engine.received[-1].json()["documents"] == ["a", [{"type": "text", "text": "d"}]]


async def test_score_token_ids_carry_no_parts_and_an_object_without_content_is_refused(gateway_factory, both) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    status, _ = await post(f"{gw.url}/v1/score", {"model": "bge", "query": [1, 2], "items": [[3, 4], [5]]})
    assert status == 200
    status, answer = await post(f"{gw.url}/v1/score", {"model": "vlm2vec", "queries": IMAGE, "documents": "d"})
    assert status == 400 and answer["error"]["param"] == "queries"
    status, answer = await post(
        f"{gw.url}/v1/score", {"model": "vlm2vec", "queries": "q", "documents": [{"content": []}, IMAGE]}
    )
    assert status == 400 and answer["error"]["param"] == "documents[1]"


async def test_embeddings_with_both_messages_and_items_read_both(gateway_factory, both) -> None:
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    body = {"model": "sg-text", "messages": TEXT_TURN, "input": [{"text": "t", "image": PNG}]}  # SGLang reads input
    status, answer = await post(f"{gw.url}/v1/embeddings", body)  # (and refuses nothing for the messages: 400 here)
    assert status == 400 and answer["error"]["param"] in ("messages[0].content", "input[0]") and text.received == []


@pytest.mark.parametrize(
    ("model", "fields", "param", "engine"),
    [
        ("sg-vision", {"messages": CONVERSATION}, "messages[0].content", "vLLM"),  # SGLang has no messages
        ("sg-vision", {"input": CONVERSATION}, "input[0].content", "vLLM"),
        ("vlm2vec", {"input": [{"text": "t", "image": PNG}]}, "input", "SGLang"),  # vLLM has no items
        ("vlm2vec", {"query": "q", "documents": [[IMAGE]]}, "documents[0]", "SGLang"),
        ("sg-vision", {"query": "q", "documents": [{"content": [IMAGE]}]}, "documents[0].content", "vLLM"),
    ],
)
async def test_a_shape_only_another_engine_reads_is_a_400_naming_it(
    gateway_factory, both, model: str, fields: dict[str, Any], param: str, engine: str
) -> None:
    """An engine silently drops (SGLang: a conversation) or refuses (vLLM: SGLang's items) what it
    does not read: the gateway says so first (issue 38, engine dialects)."""
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    path = "/v1/embeddings" if "query" not in fields else "/v1/rerank"
    status, answer = await post(gw.url + path, {"model": model, **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert f"is {engine}'s shape, which model '{model}' does not take" in answer["error"]["message"]
    assert vision.received == []


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/embeddings", {"input": [{"role": "user", "text": "a", "image": PNG}]}, "input[0]"),
        ("/v1/embeddings", {"input": [{"role": "user", "content": "hi", "video": PNG}]}, "input[0]"),
        ("/v1/rerank", {"query": [{**IMAGE, "content": "x"}], "documents": ["a"]}, "query[0]"),
        ("/v1/rerank", {"query": "q", "documents": [{**IMAGE, "content": [IMAGE]}]}, "documents[0]"),
        ("/v1/score", {"queries": {"type": "text", "text": "q", "content": []}, "documents": "d"}, "queries"),
    ],
)
async def test_an_object_two_engines_read_two_ways_is_refused(gateway_factory, both, path, fields, param) -> None:
    """An item SGLang reads as media and vLLM as a message (or the other way round) is a 400:
    the gateway could count it only one way (issue 38's review)."""
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    status, answer = await post(gw.url + path, {"model": "vlm2vec", **fields})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert vision.received == []


async def test_the_openai_sdk_gets_a_shape_refusal_and_a_video_embeds_refusal_in_openais_error_shape(
    gateway_factory, both
) -> None:
    """The real client: a shape the model's engine does not read, and vLLM's video_embeds part (a
    video) to a model that takes none, each a 400 in OpenAI's error shape (issue 38)."""
    text, vision = both
    gw = await gateway_factory(table(text, vision))
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(model="vlm2vec", input=[{"text": "t", "image": PNG}])
        error = error_body(caught.value)
        assert error["param"] == "input" and error["type"] == "invalid_request_error"
        assert "is SGLang's shape, which model 'vlm2vec' does not take" in error["message"]
        embeds = {"type": "video_embeds", "video_embeds": "AAAA"}
        with pytest.raises(openai.BadRequestError) as caught:
            await client.embeddings.create(
                model="vlm2vec", input="", extra_body={"messages": [{"role": "user", "content": [embeds]}]}
            )
        error = error_body(caught.value)
        assert error["code"] == "unsupported_modality" and error["param"] == "messages[0].content[0]"
    assert vision.received == []
