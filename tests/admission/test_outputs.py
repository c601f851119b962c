"""gateway.admission.outputs: what a request asks a model to produce, read where each API asks it,
and what becomes of an output the model does not produce; through the gateway, with the openai
SDK as its client: produced, refused with the param named, redirected."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.admission.outputs import chat_outputs, responses_outputs
from gateway.admission.plan import admit
from gateway.config import parse_config
from gateway.errors import InvalidRequestError, UnsupportedOutputModalityError
from gateway.modalities import Modality
from tests.conftest import Gateway, Upstream, error_body, routing

HI = [{"role": "user", "content": "hi"}]


def table(upstream: str = "http://127.0.0.1:1") -> str:
    return f"""
version: 1
models:
  - name: talker
    upstreams: [{upstream}]
    accepts: [text, audio]
    produces: [text, audio]
    apis: [chat, responses, speech]
  - name: painter
    upstreams: [{upstream}]
    accepts: [text, image]
    produces: [text, image]
    limits: {{image: 2}}
    apis: [chat, responses, images, edits]
  - name: texty
    upstreams: [{upstream}]
    accepts: [text]
    on_unsupported_output:
      audio: {{redirect: talker}}
  - name: plain
    upstreams: [{upstream}]
    accepts: [text, image]
"""


@pytest.mark.parametrize(
    ("body", "asked"),
    [
        ({"messages": HI}, []),
        ({"modalities": ["text"]}, []),
        ({"modalities": ["text", "audio"], "audio": {"voice": "alloy"}}, [(Modality.AUDIO, "modalities[1]")]),
        ({"audio": {"voice": "alloy", "format": "wav"}}, [(Modality.AUDIO, "audio")]),
        ({"modalities": ["image"]}, [(Modality.IMAGE, "modalities[0]")]),
        ({"modalities": ["text"], "audio": {"voice": "alloy"}}, []),  # modalities decides; audio sets a voice
    ],
)  # fmt: skip
def test_chat_asks_in_modalities_and_audio(body: dict[str, Any], asked: list[tuple[Modality, str]]) -> None:
    assert chat_outputs(body) == asked


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"modalities": "audio"}, "modalities", "'modalities' must be a list of strings"),
        ({"modalities": ["text", "auido"]}, "modalities[1]", "unknown output modality 'auido' in 'modalities' "
         "(expected text, audio or image); did you mean 'audio'?"),
        ({"modalities": [7]}, "modalities[0]", "unknown output modality 'int' in 'modalities'"),
        ({"modalities": ["video"]}, "modalities[0]", "unknown output modality 'video' in 'modalities'"),
    ],
)  # fmt: skip
def test_chat_modalities_that_name_nothing_are_a_400(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        chat_outputs(body)
    assert refused.value.param == param and refused.value.message.startswith(message)


def test_the_responses_api_asks_for_images_with_its_image_generation_tool() -> None:
    tools = [{"type": "function", "name": "f"}, {"type": "image_generation", "size": "1024x1024"}]
    assert responses_outputs({"tools": tools}) == [(Modality.IMAGE, "tools[1]")]
    assert responses_outputs({"input": "hi"}) == [] and responses_outputs({"tools": "x"}) == []


def test_a_model_that_does_not_produce_it_refuses_naming_the_param_or_redirects() -> None:
    config = parse_config(table())
    audio = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}, "messages": HI}
    assert admit(config, {"model": "talker", **audio}).model.name == "talker"
    with pytest.raises(UnsupportedOutputModalityError) as refused:
        admit(config, {"model": "plain", **audio})
    error = refused.value
    assert (error.status, error.code, error.param) == (400, "unsupported_output_modality", "modalities[1]")
    assert error.message == "Model 'plain' does not produce audio output (it produces: text)"
    assert error.rejection is not None and error.rejection.reason == "unsupported_output"
    plan = admit(config, {"model": "texty", **audio})
    assert (plan.model.name, plan.route, [r.target for r in plan.redirects]) == ("talker", "redirect", ["talker"])
    # a key that may not use the target: refused as the model's own
    with pytest.raises(UnsupportedOutputModalityError):
        admit(config, {"model": "texty", **audio}, visible=lambda name: name != "talker")


def test_check_holds_outputs_to_what_models_produce() -> None:
    from gateway.errors import ConfigError

    bad = table().replace("audio: {redirect: talker}", "audio: {redirect: painter}\n      image: reject")
    bad = bad.replace(
        "    accepts: [text, image]\n    produces: [text, image]",
        "    accepts: [text, image]\n    produces: [text, image, smell]",
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(bad, filename="r.yaml")
    said = str(refused.value)
    assert "models[1].produces[2]: unknown output modality 'smell' (expected one of: text, audio, image)" in said
    assert "models[2].on_unsupported_output.audio.redirect: redirect target 'painter' does not produce 'audio'" in said
    mute = table().replace(
        "    produces: [text, audio]\n    apis: [chat, responses, speech]", "    apis: [chat, speech]"
    )
    with pytest.raises(ConfigError) as refused:
        parse_config(mute, filename="r.yaml")
    assert "models[0].apis: the speech API answers with audio: the model must produce it (produces:)" in str(
        refused.value
    )


# -- through the gateway, with the openai SDK --------------------------------------------------


async def _gateway(gateway_factory: Any, upstream: Upstream) -> Gateway:
    gw: Gateway = await gateway_factory(table(upstream.url))
    return gw


async def test_chat_with_audio_out_is_produced_refused_or_redirected(gateway_factory, upstream: Upstream) -> None:
    gw = await _gateway(gateway_factory, upstream)
    audio: dict[str, Any] = {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}
    async with gw.client() as client:
        made = await client.chat.completions.with_raw_response.create(model="talker", messages=HI, **audio)
        assert made.headers["X-Gateway-Route"] == "direct"
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="plain", messages=HI, **audio)
        moved = await client.chat.completions.with_raw_response.create(model="texty", messages=HI, **audio)
    sent = upstream.received[0].json()
    assert sent["modalities"] == ["text", "audio"] and sent["audio"] == {"voice": "alloy", "format": "wav"}
    body = error_body(refused.value)
    assert (body["code"], body["param"]) == ("unsupported_output_modality", "modalities[1]")
    assert (moved.headers["X-Gateway-Route"], moved.headers["X-Gateway-Model"]) == ("redirect", "talker")
    assert upstream.received[-1].json()["model"] == "talker" and len(upstream.received) == 2  # the refusal sent nothing
    labels = {"model": "plain", "modality": "audio", "reason": "unsupported_output", "api": "chat"}
    assert gw.sample("gateway_modality_rejections_total", **labels) == 1
    assert gw.sample("gateway_modality_redirects_total", model="texty", modality="audio", target="talker") == 1


async def test_a_responses_image_generation_tool_is_refused_by_a_model_that_makes_no_images(
    gateway_factory, upstream: Upstream
) -> None:
    gw = await _gateway(gateway_factory, upstream)
    tool: Any = {"type": "image_generation"}
    async with gw.client() as client:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="plain", input="a cat", tools=[tool])
        await client.responses.create(model="painter", input="a cat", tools=[tool])
    body = error_body(refused.value)
    assert (body["code"], body["param"]) == ("unsupported_output_modality", "tools[0]")
    assert [r.json()["model"] for r in upstream.received] == ["painter"]


async def test_the_images_and_speech_apis_are_served_by_models_that_make_them(
    gateway_factory, upstream: Upstream
) -> None:
    from tools.standin import TINY_PNG

    gw = await _gateway(gateway_factory, upstream)
    async with gw.client() as client:
        images = await client.images.generate(model="painter", prompt="a cat in a hat", n=2)
        speech = await client.audio.speech.create(model="talker", input="hello there", voice="alloy")
        refusals = []
        for call in (
            client.images.generate(model="plain", prompt="a cat"),
            client.audio.speech.create(model="plain", input="hi", voice="alloy"),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await call
            refusals.append(error_body(refused.value))
    assert [d.b64_json for d in images.data or []] == [TINY_PNG, TINY_PNG]
    assert speech.content.startswith(b"RIFF") and speech.response.headers["X-Gateway-Model"] == "talker"
    assert [(r["code"], r["param"]) for r in refusals] == [("unsupported_output_modality", "model")] * 2
    assert [r.path for r in upstream.received] == ["/v1/images/generations", "/v1/audio/speech"]
    assert gw.sample("gateway_requests_total", model="painter", api="images", code="200") == 1
    labels = {"model": "plain", "reason": "unsupported_output"}
    assert gw.sample("gateway_modality_rejections_total", modality="image", api="images", **labels) == 1
    assert gw.sample("gateway_modality_rejections_total", modality="audio", api="speech", **labels) == 1


def test_an_input_redirect_is_held_to_the_outputs_asked_and_never_loops_back() -> None:
    """Both kinds in one request: the model it ends at must produce what was asked; an input
    redirect back to the model an output redirect left is not taken (a 400, never a 500)."""
    config = parse_config(
        """
version: 1
models:
  - {name: c, upstreams: ['http://h:1'], accepts: [text], produces: [text, audio],
     on_unsupported: {video: {redirect: d}}}
  - {name: d, upstreams: ['http://h:1'], accepts: [text, video]}
  - {name: a, upstreams: ['http://h:1'], accepts: [text, image], on_unsupported_output: {audio: {redirect: b}}}
  - {name: b, upstreams: ['http://h:1'], accepts: [text], produces: [text, audio],
     on_unsupported: {image: {redirect: a}}}
"""
    )
    audio = {"modalities": ["text", "audio"]}
    clip = {"type": "video_url", "video_url": {"url": "https://example.com/a.mp4"}}
    with pytest.raises(UnsupportedOutputModalityError) as refused:
        admit(config, {"model": "c", **audio, "messages": [{"role": "user", "content": [clip]}]})
    assert refused.value.param == "modalities[1]"
    assert refused.value.message == "Model 'd' (redirected from 'c') does not produce audio output (it produces: text)"
    picture = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    from gateway.errors import UnsupportedModalityError

    with pytest.raises(UnsupportedModalityError) as looped:
        admit(config, {"model": "a", **audio, "messages": [{"role": "user", "content": [picture]}]})
    assert looped.value.message.startswith(
        "Model 'b' (redirected from 'a' for audio output) does not accept image input"
    )


def test_check_lets_an_input_redirect_skip_the_output_apis_and_wants_text_where_text_is_served() -> None:
    from gateway.errors import ConfigError

    fine = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: omni, upstreams: ['http://h:1'], accepts: [text, audio], apis: [chat, speech],\n"
        "     produces: [text, audio], on_unsupported: {video: {redirect: vl}}}\n"
        "  - {name: vl, upstreams: ['http://h:1'], accepts: [text, video], apis: [chat]}\n"
        "  - {name: img, upstreams: ['http://h:1'], accepts: [text], apis: [images], produces: [image]}\n"
    )
    assert fine.model("img") is not None and fine.model("img").produces == (Modality.IMAGE,)  # type: ignore[union-attr]
    with pytest.raises(ConfigError) as refused:
        parse_config(
            "version: 1\nmodels:\n  - {name: bad, upstreams: ['http://h:1'], accepts: [text], produces: [image]}\n",
            filename="r.yaml",
        )
    assert "models[0].produces: must include 'text': the model serves chat, completions, responses, messages" in str(
        refused.value
    )


async def test_an_image_edit_is_admitted_as_its_images_are_and_as_its_model_produces(
    gateway_factory, upstream: Upstream
) -> None:
    """``images.edit`` (multipart): the model produces images and takes them in, each image within
    media.max_image_bytes, the images within limits.image; forwarded as the SDK sent it."""
    import orjson

    from tests.images import png

    gw = await _gateway(gateway_factory, upstream)
    picture = ("in.png", png(), "image/png")
    async with gw.client() as client:
        edited = await client.images.edit(model="painter", image=picture, prompt="add a hat", mask=picture)
        refusals = []
        for model, images in (("plain", [picture]), ("talker", [picture]), ("painter", [picture] * 3)):
            with pytest.raises(openai.BadRequestError) as refused:
                await client.images.edit(model=model, image=images, prompt="add a hat")
            refusals.append(error_body(refused.value))
    assert edited.data is not None and edited.data[0].b64_json
    sent = {name: (filename, small) for name, filename, _, _, small in orjson.loads(upstream.received[0].body)}
    assert sent["image"][0] == "in.png" and sent["mask"][0] == "in.png"
    assert (sent["prompt"][1], sent["model"][1]) == ("add a hat", "painter")
    assert [(r["code"], r["param"]) for r in refusals] == [
        ("unsupported_output_modality", "model"),  # plain makes no images
        ("unsupported_output_modality", "model"),  # talker neither
        ("too_many_items", "image"),  # painter: 2 a request
    ]
    assert len(upstream.received) == 1  # no refusal reached the engine


def test_an_edit_to_a_model_that_takes_no_images_in_is_refused_at_the_image() -> None:
    from gateway.admission.upload import EDITS, admit_edit, parse_form
    from gateway.errors import UnsupportedModalityError

    config = parse_config(
        "version: 1\nmodels:\n  - {name: drawer, upstreams: ['http://h:1'], accepts: [text], produces: [text, image],"
        " apis: [edits]}\n"
    )
    body = (
        b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\nPNG\r\n'
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\ndrawer\r\n--b--\r\n'
    )
    form = parse_form(body, "multipart/form-data; boundary=b")
    drawer = config.model("drawer")
    assert drawer is not None
    with pytest.raises(UnsupportedModalityError) as refused:
        admit_edit(config, form, None, requested=drawer, api=EDITS)
    assert refused.value.param == "image" and "does not accept image input" in refused.value.message
    # one that sends images to a model that takes and makes them: the edit goes there
    sends = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: drawer, upstreams: ['http://h:1'], accepts: [text], produces: [text, image], apis: [edits],\n"
        "     on_unsupported: {image: {redirect: painter}}}\n"
        "  - {name: painter, upstreams: ['http://h:1'], accepts: [text, image], produces: [text, image],\n"
        "     apis: [edits]}\n"
    )
    first = sends.model("drawer")
    assert first is not None
    plan = admit_edit(sends, form, None, requested=first, api=EDITS)
    assert (plan.model.name, plan.route) == ("painter", "redirect")
    with pytest.raises(UnsupportedModalityError):  # not where the key may not go
        admit_edit(sends, form, lambda name: name != "painter", requested=first, api=EDITS)


# -- the images a request asks for: output_limits, how they come back, redirects on the output APIs --


def drawing_table(upstream: str) -> str:
    return f"""
version: 1
models:
  - name: painter
    upstreams: [{upstream}]
    accepts: [text, image]
    produces: [text, image]
    apis: [chat, responses, images, edits]
    output_limits: {{image: 2, image_sizes: [1024x1024, 512x512], image_pixels: 1048576}}
  - name: atelier                      # its replicas write to storage every client reaches
    upstreams: [{upstream}]
    accepts: [text, image]
    produces: [image]
    apis: [images, edits]
    image_urls: shared
  - name: talker
    upstreams: [{upstream}]
    accepts: [text]
    produces: [text, audio]
    apis: [chat, speech]
  - name: texty
    upstreams: [{upstream}]
    accepts: [text]
    on_unsupported_output:
      image: {{redirect: painter}}
      audio: {{redirect: talker}}
  - name: sketchy
    upstreams: [{upstream}]
    accepts: [text]
    apis: [chat]
    on_unsupported_output: {{audio: {{redirect: talker}}}}
"""


async def test_images_asked_are_held_to_the_models_output_limits(gateway_factory, upstream: Upstream) -> None:
    """``n`` and the size (``size``, or SGLang's ``width`` and ``height``, which win over it) within
    ``output_limits``, on the images and edits APIs; each refusal a 400 naming its param before
    the engine, counted as an output limit."""
    from tests.images import png

    gw: Gateway = await gateway_factory(drawing_table(upstream.url))
    picture = ("in.png", png(), "image/png")
    async with gw.client() as client:
        await client.images.generate(model="painter", prompt="a cat", n=2, size="512x512")
        await client.images.edit(model="painter", image=picture, prompt="a hat", n=2, size="1024x1024")
        await client.responses.create(
            model="painter", input="a cat", tools=[{"type": "image_generation", "size": "512x512"}]
        )
        refusals = []
        for call in (
            client.images.generate(model="painter", prompt="a cat", n=3),
            client.images.generate(model="painter", prompt="a cat", size="1792x1024"),
            client.images.generate(model="painter", prompt="a cat", size="big"),
            client.images.generate(model="painter", prompt="a cat", extra_body={"width": 2048, "height": 2048}),
            client.images.generate(model="painter", prompt="a cat", extra_body={"width": 512}),
            client.images.generate(model="painter", prompt="a cat", extra_body={"n": "2"}),
            client.images.edit(model="painter", image=picture, prompt="a hat", n=3),
            client.images.edit(model="painter", image=picture, prompt="a hat", size="256x256"),
            client.responses.create(
                model="painter", input="a cat", tools=[{"type": "image_generation", "size": "1536x1024"}]
            ),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await call
            refusals.append(error_body(refused.value))
    assert [(r["code"], r["param"]) for r in refusals] == [
        ("too_many_items", "n"),
        ("invalid_request", "size"),
        ("invalid_request", "size"),
        ("invalid_request", "width"),
        ("invalid_request", "height"),
        ("invalid_request", "n"),
        ("too_many_items", "n"),
        ("invalid_request", "size"),
        ("invalid_request", "tools[0].size"),
    ]
    assert refusals[0]["message"] == "Model 'painter' makes at most 2 image(s) per request; 'n' asks 3"
    assert refusals[1]["message"] == (
        "Model 'painter' makes images of the sizes 1024x1024, 512x512; the request asks 1792x1024"
    )
    assert refusals[3]["message"].startswith("Model 'painter' makes images of the sizes")
    assert len(upstream.received) == 3  # no refusal reached the engine
    labels = {"model": "painter", "modality": "image", "reason": "output_limit"}
    assert gw.sample("gateway_modality_rejections_total", api="images", **labels) == 3
    assert gw.sample("gateway_modality_rejections_total", api="responses", **labels) == 1
    assert gw.sample("gateway_modality_rejections_total", api="edits", **labels) == 2


async def test_generated_images_come_back_inline_unless_the_replicas_share_storage(
    gateway_factory, upstream: Upstream
) -> None:
    """A model's replicas each keep the images they make (SGLang answers a URL of
    ``/v1/images/{id}/content`` on itself): base64 is asked where the request says nothing, a URL
    refused; a model whose replicas share storage (``image_urls: shared``) answers as asked."""
    import orjson

    from tests.images import png
    from tools.standin import TINY_PNG

    gw: Gateway = await gateway_factory(drawing_table(upstream.url))
    async with gw.client() as client:
        inline = await client.images.generate(model="painter", prompt="a cat")
        edited = await client.images.edit(model="painter", image=("in.png", png(), "image/png"), prompt="a hat")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.images.generate(model="painter", prompt="a cat", response_format="url")
        shared = await client.images.generate(model="atelier", prompt="a cat", response_format="url")
        unsaid = await client.images.generate(model="atelier", prompt="a cat")  # SGLang's default: a URL
    assert inline.data is not None and inline.data[0].b64_json == TINY_PNG and inline.data[0].url is None
    assert edited.data is not None and edited.data[0].b64_json == TINY_PNG
    body = error_body(refused.value)
    assert (body["code"], body["param"]) == ("invalid_request", "response_format")
    assert "image_urls: shared" in body["message"]
    assert shared.data is not None and shared.data[0].url is not None and shared.data[0].url.endswith("/content")
    assert unsaid.data is not None and unsaid.data[0].url is not None
    generated, edit, *others = upstream.received
    assert generated.json()["response_format"] == "b64_json"
    sent = {name: small for name, _, _, _, small in orjson.loads(edit.body)}
    assert sent["response_format"] == "b64_json" and sent["model"] == "painter"
    assert [r.json().get("response_format") for r in others] == ["url", None]  # atelier's: as the client sent


async def test_the_output_apis_follow_a_models_redirect_for_the_output(gateway_factory, upstream: Upstream) -> None:
    """A request on the images or speech API that names a model that makes no such output goes
    where its ``on_unsupported_output`` sends it, a model that makes it and serves the API; none
    (or one that does not serve the API): 400 at ``model``."""
    gw: Gateway = await gateway_factory(drawing_table(upstream.url))
    async with gw.client() as client:
        images = await client.images.with_raw_response.generate(model="texty", prompt="a cat")
        speech = await client.audio.speech.with_raw_response.create(model="texty", input="hi there", voice="alloy")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.images.generate(model="talker", prompt="a cat")  # no redirect for images
        with pytest.raises(openai.BadRequestError) as limited:
            await client.images.generate(model="texty", prompt="a cat", n=5)  # the target's limits hold
    for raw, target in ((images, "painter"), (speech, "talker")):
        assert (raw.headers["X-Gateway-Model"], raw.headers["X-Gateway-Route"]) == (target, "redirect")
    assert [r.json()["model"] for r in upstream.received] == ["painter", "talker"]
    assert upstream.received[0].json()["response_format"] == "b64_json"
    assert (error_body(refused.value)["code"], error_body(refused.value)["param"]) == (
        "unsupported_output_modality",
        "model",
    )
    assert error_body(limited.value)["message"].startswith("Model 'painter' makes at most 2 image(s)")
    assert gw.sample("gateway_modality_redirects_total", model="texty", modality="image", target="painter") == 1
    assert gw.sample("gateway_requests_total", model="texty", api="images", code="200") == 1


def test_output_limits_and_image_urls_are_checked_with_their_line() -> None:
    from gateway.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_config(
            "version: 1\nmodels:\n"
            "  - {name: t, upstreams: ['http://h:1'], accepts: [text], output_limits: {image: 2}, image_urls: shared}\n"
            "  - name: p\n    upstreams: ['http://h:1']\n    accepts: [text]\n    produces: [text, image]\n"
            "    output_limits: {image: 0, image_sizes: [1024x1024, big, 1024X1024], image_pixels: 1000, images: 2}\n"
            "    image_urls: sharde\n",
            filename="r.yaml",
        )
    said = str(refused.value).splitlines()
    assert said == [
        "r.yaml:3:59: models[0].output_limits: is for a model that makes images (produces: [..., image])",
        "r.yaml:3:86: models[0].image_urls: is for a model that makes images (produces: [..., image])",
        "r.yaml:8:28: models[1].output_limits.image: must be between 1 and 1024, not 0",
        "r.yaml:8:45: models[1].output_limits.image_sizes[0]: 1024x1024 is over image_pixels (1000): it could never "
        "be asked",
        "r.yaml:8:56: models[1].output_limits.image_sizes[1]: must be WIDTHxHEIGHT (1024x1024), not 'big'",
        "r.yaml:8:61: models[1].output_limits.image_sizes[2]: 1024X1024 is over image_pixels (1000): it could never "
        "be asked",
        "r.yaml:8:93: models[1].output_limits.images: unknown key 'images' (expected one of: image, image_sizes, "
        "image_pixels, speech_input_chars); did you mean 'image'?",
        "r.yaml:9:17: models[1].image_urls: unknown value 'sharde' (expected one of: inline, shared); did you mean "
        "'shared'?",
    ]


def test_a_forms_fields_are_replaced_where_they_lie_and_added_before_its_end() -> None:
    from gateway.admission.upload import parse_form

    body = (
        b'--b\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n'
        b'--b\r\nContent-Disposition: form-data; name="image"; filename="a.png"\r\n\r\nPNG\r\n--b--\r\n'
    )
    written = parse_form(body, "multipart/form-data; boundary=b").with_values({"model": "up", "response_format": "x"})
    again = parse_form(written, "multipart/form-data; boundary=b")
    assert [(f.name, f.filename, written[f.start : f.end]) for f in again.fields] == [
        ("model", None, b"up"),
        ("image", "a.png", b"PNG"),
        ("response_format", None, b"x"),
    ]
    assert written.endswith(b"\r\n--b--\r\n")


async def test_what_sglang_reads_of_an_images_request_is_what_is_held_to_the_limits(
    gateway_factory, upstream: Upstream
) -> None:
    """The size and format as SGLang reads them: ``response_format`` of any case; an edit's
    ``size`` alone (its form has no width or height); a request of no size asked the first size
    the table lists; a form's ``n`` of digits only; an edit follows the model's output redirect."""
    import orjson

    from tests.images import png

    gw: Gateway = await gateway_factory(drawing_table(upstream.url))
    picture = ("in.png", png(), "image/png")
    async with gw.client() as client:
        await client.images.generate(model="painter", prompt="a cat")  # no size: the first listed asked
        edit = await client.images.with_raw_response.edit(model="texty", image=picture, prompt="a hat")
        refusals = []
        for call in (
            client.images.generate(model="painter", prompt="a cat", response_format="URL"),
            client.images.edit(
                model="painter",
                image=picture,
                prompt="a hat",
                size="1536x1024",
                extra_body={"width": 512, "height": 512},
            ),
            client.images.edit(model="painter", image=picture, prompt="a hat", extra_body={"n": "²"}),
        ):
            with pytest.raises(openai.BadRequestError) as refused:
                await call
            refusals.append(error_body(refused.value))
    assert [(r["code"], r["param"]) for r in refusals] == [
        ("invalid_request", "response_format"),
        ("invalid_request", "size"),
        ("invalid_request", "n"),
    ]
    generated, edited = upstream.received
    assert generated.json()["size"] == "1024x1024"
    assert (edit.headers["X-Gateway-Model"], edit.headers["X-Gateway-Route"]) == ("painter", "redirect")
    sent = {name: small for name, _, _, _, small in orjson.loads(edited.body)}
    assert (sent["model"], sent["size"], sent["response_format"]) == ("painter", "1024x1024", "b64_json")


def test_a_responses_image_tool_is_held_to_the_limits_of_the_model_that_serves_it() -> None:
    """An input redirect moves the request: the tool's size is held to the target's limits."""
    from gateway.admission.apis.catalog import BY_NAME

    config = parse_config(
        "version: 1\nmodels:\n"
        "  - {name: gen, upstreams: ['http://h:1'], accepts: [text], produces: [text, image],\n"
        "     on_unsupported: {image: {redirect: painter}}}\n"
        "  - {name: painter, upstreams: ['http://h:1'], accepts: [text, image], produces: [text, image],\n"
        "     output_limits: {image_sizes: [512x512]}}\n"
    )
    picture = {"type": "input_image", "image_url": "https://example.com/a.png"}
    body = {
        "model": "gen",
        "input": [{"role": "user", "content": [picture]}],
        "tools": [{"type": "image_generation", "size": "1536x1024"}],
    }
    with pytest.raises(InvalidRequestError) as refused:
        admit(config, body, api=BY_NAME["responses"])
    assert refused.value.param == "tools[0].size" and "Model 'painter' makes images of the sizes 512x512" in str(
        refused.value
    )


async def test_speech_is_held_to_the_characters_its_model_speaks_at_once(gateway_factory, upstream: Upstream) -> None:
    from gateway.errors import ConfigError

    gw: Gateway = await gateway_factory(
        routing(
            f"  - {{name: tts, upstreams: [{upstream.url}], accepts: [text], produces: [audio], apis: [speech],"
            " output_limits: {speech_input_chars: 20}}"
        )
    )
    async with gw.client() as client:
        spoken = await client.audio.speech.create(model="tts", input="a short line", voice="alloy")
        with pytest.raises(openai.BadRequestError) as refused:
            await client.audio.speech.create(model="tts", input="a line a little too long to say", voice="alloy")
    assert spoken.content.startswith(b"RIFF")
    body = error_body(refused.value)
    assert (body["code"], body["param"]) == ("invalid_request", "input")
    assert body["message"] == "Model 'tts' speaks at most 20 characters a request; 'input' has 31 (send it in parts)"
    assert len(upstream.received) == 1
    labels = {"model": "tts", "modality": "audio", "reason": "output_limit", "api": "speech"}
    assert gw.sample("gateway_modality_rejections_total", **labels) == 1
    with pytest.raises(ConfigError) as wrong:
        parse_config(
            routing(
                "  - {name: t, upstreams: ['http://h:1'], accepts: [text], output_limits: {speech_input_chars: 9}}"
            ),
            filename="r.yaml",
        )
    assert "models[0].output_limits.speech_input_chars: is for a model that makes audio" in str(wrong.value)


def test_an_empty_response_format_is_none_given_and_a_bad_one_is_said_before_the_engine() -> None:
    from gateway.admission.outputs import generation

    config = parse_config(drawing_table("http://127.0.0.1:1"))
    atelier = config.model("atelier")
    assert atelier is not None
    assert generation(atelier, {"response_format": ""}.get) == {}  # as the engines read it: not given
    assert generation(atelier, {"response_format": "", "n": "1"}.get, form=True) == {}
    for field, value in (("response_format", "jpeg"), ("response_format", 7), ("size", "1024x10000000")):
        with pytest.raises(InvalidRequestError) as refused:
            generation(atelier, {field: value}.get)
        assert refused.value.param == field
