"""The doors of audio uploads: ``/v1/audio/transcriptions`` and ``/v1/audio/translations``
(multipart/form-data, as the OpenAI SDK and vLLM's Whisper serving speak them). The form is
admitted under the table (gateway.admission.upload) and forwarded as sent, its ``model`` renamed
for the upstream where it must be; a streamed transcription (``stream=true``) is relayed event
by event."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from ..admission.apis import Api
from ..admission.upload import admit_upload, lookup_upload
from . import exchange


async def _upload(request: web.Request, api: Api) -> web.StreamResponse:
    ex, form = await exchange.begin_upload(request)
    requested = lookup_upload(ex.config, form, ex.visible, api)
    ex.serve_with(requested)
    plan = admit_upload(ex.config, form, ex.visible, requested=requested, api=api)
    ex.admitted(plan)
    data = form.body
    if form.value("model") != plan.model.upstream_name:
        data = form.with_value("model", plan.model.upstream_name)
    return await exchange.forward(ex, data, content_type=request.headers["Content-Type"])


def door(api: Api) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of an upload API (transcriptions, translations)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return await _upload(request, api)

    handler.__name__ = handler.__qualname__ = f"{api.name}_handler"
    return handler
