"""The doors of uploads (multipart/form-data, as the OpenAI SDK and the engines speak them):
``/v1/audio/transcriptions`` and ``/v1/audio/translations`` (vLLM's Whisper serving), and
``/v1/images/edits`` (an image to edit, and its mask). The form is admitted under the table
(gateway.admission.upload) and forwarded as sent, its ``model`` renamed for the upstream where it
must be; a streamed transcription (``stream=true``) is relayed event by event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ..admission.apis import Api
from ..admission.body import read_body
from ..admission.outputs import generation
from ..admission.upload import Form, admit_upload, lookup_upload, parse_form
from ..metrics import UNKNOWN_MODEL
from ..modalities import Modality
from . import exchange
from .exchange import Exchange
from .state import MODEL_LABEL_KEY, SERVICES_KEY, admitted_as, left_by_the_door


async def _upload(request: web.Request, api: Api) -> web.StreamResponse:
    ex, form = await _begin(request)
    requested = lookup_upload(ex.config, form, ex.visible, api)
    ex.serve_with(requested)
    plan = admit_upload(ex.config, form, ex.visible, requested=requested, api=api)
    ex.admitted(plan)
    setting = generation(plan.model, form.value, form=True) if api.makes is Modality.IMAGE else {}
    if form.value("model") != plan.model.upstream_name:
        setting["model"] = plan.model.upstream_name
    data = form.with_values(setting) if setting else form.body
    return await exchange.forward(ex, data, content_type=request.headers["Content-Type"])


def door(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of an upload API (transcriptions, translations, edits)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await _upload(request, api)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler


async def _begin(request: web.Request) -> tuple[Exchange, Form]:
    """The exchange of an upload (multipart/form-data), its form read where its parts lie."""
    services = request.app[SERVICES_KEY]
    live = services.store.live
    request[MODEL_LABEL_KEY] = UNKNOWN_MODEL
    key, priority = admitted_as(request)
    allowed, tab = left_by_the_door(request, key)
    server = live.config.server
    raw = await read_body(request, timeout_s=server.client_body_timeout_s, max_bytes=services.max_body_bytes)
    form = parse_form(raw, request.headers.get("Content-Type", ""))
    streamed = (form.value("stream") or "").lower() == "true"
    recording = services.tracing is not None and services.tracing.recording()
    begun = Exchange(
        request, services, live, live.config, allowed, raw, {}, None, streamed, priority, key, tab, recording
    )
    return begun, form
