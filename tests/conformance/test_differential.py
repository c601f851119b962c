"""What the engine reads is what the gateway classified: bodies generated with hypothesis are
admitted by the gateway (its plan, and the body it would send upstream) and parsed by vLLM 0.33's
own code; wherever both take a body, the media each counts agree, modality by modality. A body the
gateway refuses is never sent (stricter is allowed); one vLLM refuses carries nothing past the
table (the engine answers it). What must never happen is a body both take in which vLLM finds
media the gateway did not count: media carried past the table.

The parts are drawn from every shape vLLM's chat parser reads: typed parts, untyped ones read by
their media key, parts with a ``uuid`` (read by their key whatever their type), cached references
(null media with a uuid), several media keys in one part, the Responses API's parts, and the
pooling APIs' conversations and score sides, with real media (a PNG, a WAV, an MP4) so that vLLM
decodes what it finds."""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.admission.apis import CHAT, Api
from gateway.admission.apis.pooling import EMBEDDINGS, RERANK, SCORE
from gateway.admission.apis.responses import RESPONSES
from gateway.admission.plan import admit
from gateway.admission.rewrite import upstream_body
from gateway.config import parse_config
from gateway.errors import GatewayError
from gateway.modalities import Modality
from tests.conftest import routing
from tests.images import data_url, png
from tests.media.test_transcribe import wav

pytestmark = pytest.mark.timeout(600)
SETTINGS = settings(
    max_examples=300,
    deadline=None,
    derandomize=True,  # the same bodies every run: CI is repeatable
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
CONFIG = parse_config(
    routing(
        "  - {name: omni, upstreams: ['http://127.0.0.1:1'], accepts: [text, image, video, audio], "
        "apis: [chat, responses, embeddings, score, rerank]}",
        "  - {name: sg, upstreams: ['http://127.0.0.1:1'], engine: sglang, accepts: [text, image, video], "
        "apis: [embeddings, rerank]}",
    )
)


@functools.cache
def media() -> dict[str, str]:
    from tests.videos import video

    return {
        "image": data_url(png(size=(32, 32))),
        "audio": "data:audio/wav;base64," + base64.b64encode(wav(0.1)).decode(),
        "video": "data:video/mp4;base64," + base64.b64encode(video(seconds=1, fps=4)).decode(),
    }


def _url(kind: str) -> st.SearchStrategy[Any]:
    """A media URL as a part carries it: an object with ``url``, a bare string, or null."""
    return st.sampled_from([{"url": media()[kind]}, media()[kind], None])


TEXT = st.builds(lambda t: {"type": "text", "text": t}, st.sampled_from(["hi", ""]))
MEDIA_KEYS = {
    "image_url": _url("image"),
    "video_url": _url("video"),
    "audio_url": _url("audio"),
    "input_audio": st.sampled_from([{"data": media()["audio"].split(",")[1], "format": "wav"}, None]),
}
TYPES = st.sampled_from(["text", "image_url", "video_url", "audio_url", "input_audio", "input_image", None])


@st.composite
def chat_part(draw: st.DrawFn) -> Any:
    """A part of any shape vLLM's chat parser reads: a type or none, one or two media keys, a
    uuid or none, a string among the parts."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.sampled_from(["plain", ""]))
    part: dict[str, Any] = {}
    kind = draw(TYPES)
    if kind is not None:
        part["type"] = kind
    if kind in ("text", None) and draw(st.booleans()):
        part["text"] = "t"
    for key in draw(st.lists(st.sampled_from(list(MEDIA_KEYS)), max_size=2, unique=True)):
        part[key] = draw(MEDIA_KEYS[key])
    if kind in MEDIA_KEYS and kind not in part:
        part[kind] = draw(MEDIA_KEYS[kind])
    if kind == "input_image":
        part["image_url"] = media()["image"]
    if draw(st.booleans()):
        part["uuid"] = draw(st.sampled_from(["u1", "u2", None]))
    return part


def chat_body(parts: list[Any]) -> dict[str, Any]:
    return {"model": "omni", "messages": [{"role": "user", "content": parts}]}


@st.composite
def responses_part(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["input_text", "input_image", "input_audio", "image_url", "input_file", "keyed"]))
    if kind == "input_text":
        return {"type": kind, "text": "t"}
    if kind == "keyed":  # a text part carrying media and a uuid: vLLM's chat parser reads it by its key
        key = draw(st.sampled_from(["image_url", "video_url", "audio_url"]))
        return {"type": "input_text", "text": "t", key: draw(_url(key.split("_")[0])), "uuid": "u"}
    if kind == "input_image":
        image = draw(st.sampled_from([media()["image"], {"url": media()["image"]}]))
        return {"type": kind, "image_url": image, **draw(st.sampled_from([{}, {"detail": "auto"}]))}
    if kind == "input_audio":
        return {"type": kind, "input_audio": {"data": media()["audio"].split(",")[1], "format": "wav"}}
    if kind == "image_url":
        return {"type": kind, "image_url": {"url": media()["image"]}}
    return {"type": kind, "file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}


def responses_body(parts: list[Any]) -> dict[str, Any]:
    return {"model": "omni", "input": [{"role": "user", "content": parts}]}


def embeddings_body(drawn: tuple[list[list[Any]], str]) -> dict[str, Any]:
    """One conversation, or a batch of them, in ``messages`` or in ``input`` (vLLM reads all four)."""
    conversations, key = drawn
    batch = [[{"role": "user", "content": parts}] for parts in conversations]
    return {"model": "omni", key: batch if len(batch) > 1 else batch[0]}


def score_body(drawn: tuple[Any, Any, tuple[str, str]]) -> dict[str, Any]:
    """Two sides under one of vLLM's four pairs of names."""
    first, second, (one, two) = drawn
    return {"model": "omni", one: first, two: second}


SCORE_SIDE = st.one_of(
    st.just("text"),
    st.builds(lambda parts: {"content": parts}, st.lists(chat_part(), max_size=3)),
    st.lists(
        st.one_of(st.just("t"), st.builds(lambda parts: {"content": parts}, st.lists(chat_part(), max_size=2))),
        min_size=1,
        max_size=3,
    ),
)

CASES = {
    "chat": (CHAT, "chat", st.lists(chat_part(), min_size=1, max_size=4).map(chat_body)),
    "responses": (RESPONSES, "responses", st.lists(responses_part(), min_size=1, max_size=3).map(responses_body)),
    "embeddings": (
        EMBEDDINGS,
        "embeddings",
        st.tuples(
            st.lists(st.lists(chat_part(), min_size=1, max_size=3), min_size=1, max_size=2),
            st.sampled_from(["messages", "input"]),
        ).map(embeddings_body),
    ),
    "score": (
        SCORE,
        "score",
        st.tuples(
            SCORE_SIDE,
            SCORE_SIDE,
            st.sampled_from(
                [("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")]
            ),
        ).map(score_body),
    ),
}


@st.composite
def sglang_item(draw: st.DrawFn) -> dict[str, Any]:
    """An SGLang embedding item, now and then with keys a chat message has (``role``, ``content``)."""
    item: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(["text", "image", "video", "role", "content"]), min_size=1, unique=True)):
        item[key] = {"text": "t", "image": media()["image"], "video": media()["video"], "role": "user"}.get(key, "c")
    return item


def sglang_embeddings_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": "sg", "input": items}


@st.composite
def sglang_rerank_part(draw: st.DrawFn) -> Any:
    """A rerank part as SGLang takes it, now and then with vLLM's ``content`` beside it."""
    part: dict[str, Any] = draw(
        st.sampled_from(
            [
                {"type": "text", "text": "t"},
                {"type": "image_url", "image_url": {"url": media()["image"]}},
                {"type": "video_url", "video_url": {"url": media()["video"]}},
            ]
        )
    )
    return {**part, "content": "x"} if draw(st.integers(0, 4)) == 0 else part


SGLANG_SIDE = st.one_of(st.just("q"), st.lists(sglang_rerank_part(), min_size=1, max_size=3))


def sglang_rerank_body(drawn: tuple[Any, list[Any]]) -> dict[str, Any]:
    query, documents = drawn
    return {"model": "sg", "query": query, "documents": documents}


SGLANG_CASES = {
    "embeddings": (
        EMBEDDINGS,
        "embeddings",
        st.lists(sglang_item(), min_size=1, max_size=3).map(sglang_embeddings_body),
    ),
    "rerank": (
        RERANK,
        "rerank",
        st.tuples(
            SGLANG_SIDE,
            st.lists(
                st.one_of(st.just("d"), st.lists(sglang_rerank_part(), min_size=1, max_size=2)), min_size=1, max_size=3
            ),
        ).map(sglang_rerank_body),
    ),
}


def gateway_counts(api: Api, body: dict[str, Any]) -> tuple[dict[str, int], dict[str, Any]] | None:
    """What the gateway counted in ``body`` and the body it would send, or None when it refuses."""
    import orjson

    raw = orjson.dumps(body)
    try:
        plan = admit(CONFIG, orjson.loads(raw), api=api)
    except GatewayError:
        return None
    sent = orjson.loads(upstream_body(plan, raw, orjson.loads(raw)))
    counts = plan.classification.counts
    return {m.value: n for m in (Modality.IMAGE, Modality.VIDEO, Modality.AUDIO) if (n := counts.get(m, 0))}, sent


def differ(
    api: Api,
    bodies: st.SearchStrategy[Any],
    engine: Callable[[dict[str, Any]], dict[str, int] | None],
    *,
    within: bool = False,
) -> dict[str, int]:
    """Each drawn body admitted by the gateway and the body it would send read by ``engine`` (its
    media counts, or None where it refuses it): wherever both take a body, the counts agree
    (``within``: the engine's modalities are among the gateway's). Returns how many bodies went
    which way."""
    seen = {"both": 0, "gateway refused": 0, "engine refused": 0}

    @SETTINGS
    @given(bodies)
    def agree(body: dict[str, Any]) -> None:
        admitted = gateway_counts(api, body)
        if admitted is None:
            seen["gateway refused"] += 1
            return
        counted, sent = admitted
        found = engine(sent)
        if found is None:
            seen["engine refused"] += 1
            return
        seen["both"] += 1
        assert (set(found) <= set(counted)) if within else (found == counted), (body, counted, found)

    agree()
    return seen


@pytest.mark.parametrize("case", list(CASES))
def test_what_vllm_finds_in_a_body_the_gateway_admits_is_what_the_gateway_counted(case: str) -> None:
    from tests.conformance.engines import vllm_side

    api, check, bodies = CASES[case]

    def read(sent: dict[str, Any]) -> dict[str, int] | None:
        try:
            return dict(getattr(vllm_side, check)(sent).counts)
        except vllm_side.Refused:
            return None

    # score: vLLM pairs a query with each document, and sees the query's media once a pair
    seen = differ(api, bodies, read, within=case == "score")
    assert seen["both"] >= 10, seen  # the generator reaches bodies both take


@pytest.mark.parametrize("case", list(SGLANG_CASES))
def test_what_sglang_finds_in_a_body_the_gateway_admits_is_what_the_gateway_counted(case: str) -> None:
    """The same for SGLang's own shapes (its embedding items, its rerank parts), with keys that
    another engine's reading would give them."""
    from tests.conformance.engines import sglang_side

    api, check, bodies = SGLANG_CASES[case]

    def read(sent: dict[str, Any]) -> dict[str, int] | None:
        try:
            return getattr(sglang_side, check)(sent).counts()
        except sglang_side.Refused:
            return None

    seen = differ(api, bodies, read)
    assert seen["both"] >= 10, seen
