"""Images a model cannot take, served as a description (``on_unsupported: {image: {describe: M}}``).

Each image part of the request (chat ``image_url``, Responses ``input_image``, Anthropic
``image``: a data URL, base64 data, or an http(s) URL fetched under the ``media:`` rules, within
``max_image_bytes``) goes to one of model M's upstreams as a chat completion: the policy's
``prompt`` and the image, ``POST /v1/chat/completions`` (M: a vision model of the table, its pool,
key, timeouts and retry budget). The part is replaced by a text part holding the answer, marked as
a description. One description per distinct image: the conversions cache (``media.cache_bytes``)
keeps it by the image's sha256, M and the prompt, and requests that carry the same image at once
share one call. A 4xx of M's (400, 413, 415, 422) is the image's fault (400 ``invalid_image``).
When every replica failed, ``on_error`` says: ``fail`` (502 ``upstream_error`` / 504
``upstream_timeout`` naming the part), ``reject`` (the 400 the model's rejection would have
been) or ``strip`` (the image dropped, as ``strip`` does). What is lost: everything the
describing model did not say, and what it got wrong: a description is one model's reading.
"""

from __future__ import annotations

import base64
import functools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..admission.parts import Part
from ..admission.route import RoutePlan
from ..config import MediaConfig, ModelConfig, Policy
from ..config.generation import Generation
from ..errors import (
    GatewayError,
    InvalidImageError,
    MediaRefusedError,
    Rejection,
    UnsupportedModalityError,
    UpstreamError,
    error_detail,
)
from ..modalities import Modality
from ..upstream.failures import read_capped
from ..upstream.replicas import Pool
from ..upstream.usage import Usage, usage_of
from .asking import MEDIA_FAULTS, Asker, Failed, GaveUp, ask, gave_up_error, json_object
from .fetch import sha256

log = logging.getLogger(__name__)
DESCRIPTION = "[Description of an image] "  # marks the text part that replaced an image (a tool's too)
MAX_REPLY_BYTES = 1 << 20  # a description: a paragraph
MAX_TOKENS = 512  # the longest description asked for
# the image formats a data URL is made for, by their first bytes (an image fetched by URL)
MAGIC = ((b"\x89PNG", "image/png"), (b"\xff\xd8\xff", "image/jpeg"), (b"GIF8", "image/gif"),
         (b"BM", "image/bmp"))  # fmt: skip


class Describer(Asker):
    """Sends images to a describing model's upstreams over one ClientSession."""

    async def describe(
        self,
        plan: RoutePlan,
        body: dict[str, Any],
        live: Generation[Pool],
        *,
        request_id: str,
        spend: Callable[[str, Usage], None] = lambda model, usage: None,
    ) -> dict[tuple[int, int], dict[str, Any]]:
        """The text part that replaces each image of ``plan.describe_parts`` (or nothing, with
        ``on_error: strip``, for one that could not be described). ``spend`` is told what each
        answer cost the describing model (its name, the reply's usage) as it comes, whatever
        becomes of the request: a description made for it (a shared one: for the request that
        began it), an empty answer too; none from the cache."""
        policy = plan.model.policy(Modality.IMAGE)
        target = live.config.model(policy.target or "")
        if target is None:  # validation forbids it; a config built in code may not
            raise UpstreamError(f"Describing model '{policy.target}' does not exist")
        job = _Job(plan, policy, target, live, request_id, spend)
        convert = functools.partial(self._one, job=job)
        return await self.each_part(plan, body, plan.describe_parts, convert, marked=DESCRIPTION)

    async def _one(self, value: Mapping[str, Any], part: Part, *, job: _Job) -> str:
        url, data = await self._data_url(value, part, job.plan.model.name, job.live.config.media)
        make = functools.partial(self._described, url, part, job)
        cache = self._cache
        if not cache.enabled:
            return await make()
        key = ("description", job.target.name, job.target.upstream_name, job.policy.prompt, await sha256(data))
        try:  # the same image again (a later turn, a parallel request): one description
            return await cache.get_or_make(
                key,
                make,
                size_of=lambda text: len(text.encode()),
                keep=lambda text: bool(text.strip()),
                shared_errors=(InvalidImageError,),  # refused by the describing model: it would be again
            )
        except InvalidImageError as exc:  # the image's fault, maybe found by a request that carried it too
            refused = Rejection(job.plan.model.name, "image", "media_refused")  # this request's model's
            raise exc.located_at(part.location, rejection=refused) from None

    async def _described(self, url: str, part: Part, job: _Job) -> str:
        """The image's description, from one of the describing model's upstreams: each try on a
        replica not tried yet, within its retries and budget and ``timeouts.total_s``."""
        started = time.perf_counter()
        text = await self._ask(url, part, job)
        model = job.plan.model.name
        self._metrics.images_described.labels(model).inc()
        self._metrics.image_describe_seconds.labels(model).observe(time.perf_counter() - started)
        return text

    async def _ask(self, url: str, part: Part, job: _Job) -> str:
        target = job.target

        def judge(status: int, data: bytes) -> str | Failed:
            if status in MEDIA_FAULTS:  # the image's fault
                raise InvalidImageError(
                    f"{part.location}: describing model '{target.name}' could not read the image "
                    f"(HTTP {status}{error_detail(data)})",
                    param=part.location,
                    rejection=Rejection(job.plan.model.name, "image", "media_refused"),
                )
            reply = json_object(data) if status == 200 else None
            text = _content(reply) if reply is not None else None
            if reply is not None and text is not None and (usage := _usage(reply)) is not None:
                job.spend(target.name, usage)  # spent, an empty answer too
            if text is None:  # failing, busy, or not a chat server
                return Failed(f"HTTP {status}" if status != 200 else "not a chat completion")
            if not text:  # a refusal; a reasoning model's tokens all spent thinking: the model's answer
                return Failed("the describing model answered with no text", final=True)
            return text

        post = functools.partial(self._post, url=url, job=job)
        try:
            return await ask(target, job.live, self._retries, post, judge)
        except GaveUp as gave_up:
            named = f"describing model '{target.name}'"
            raise gave_up_error(
                gave_up,
                part.location,
                late=f"{named} sent no description in time",
                failed=f"no upstream of {named} could describe the image",
            ) from None

    async def _post(self, replica: str, left: float | None, *, url: str, job: _Job) -> tuple[int, bytes]:
        """One try: the chat completion that asks for the description, its status and body."""
        assert self._session is not None, "Describer.start() was not called"
        target = job.target
        headers = self.headers(target, job.live, job.request_id, **{"Content-Type": "application/json"})
        content = [{"type": "text", "text": job.policy.prompt}, {"type": "image_url", "image_url": {"url": url}}]
        payload = {
            "model": target.upstream_name,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "stream": False,
        }
        t = target.timeouts
        timeout = aiohttp.ClientTimeout(total=left, connect=t.connect_s, sock_read=t.first_byte_s)
        async with self._session.post(
            f"{replica}/v1/chat/completions", data=orjson.dumps(payload), headers=headers, timeout=timeout
        ) as resp:
            return resp.status, await read_capped(resp, MAX_REPLY_BYTES)

    async def _data_url(
        self, value: Mapping[str, Any], part: Part, model: str, media: MediaConfig
    ) -> tuple[str, bytes]:
        """The image as a data URL (as sent, or made of the bytes fetched), and its bytes."""
        source = _source(value)
        if source is None:
            what = "embeddings" if part.type == "image_embeds" else "a reference (no image)"
            raise UnsupportedModalityError(
                f"Model '{model}' does not accept image input, and {part.location} ('{part.type}') cannot be "
                f"described: it carries {what}",
                param=part.location,
                rejection=Rejection(model, "image", "unsupported"),
            )
        try:
            data = await self._fetcher.load(source, "image", media)  # the size limit, and the fetch rules
        except GatewayError as exc:
            kind = MediaRefusedError if isinstance(exc, MediaRefusedError) else InvalidImageError
            refused = Rejection(model, "image", "media_refused")
            raise kind(f"{part.location}: {exc.message}", param=part.location, rejection=refused) from None
        if source.startswith("data:"):
            return source, data
        webp = data[:4] == b"RIFF" and data[8:12] == b"WEBP"
        mime = "image/webp" if webp else next((m for magic, m in MAGIC if data.startswith(magic)), None)
        if mime is None:  # labelled by what its bytes are, never by a guess
            raise InvalidImageError(
                f"{part.location}: what its URL returned is not an image (PNG, JPEG, GIF, BMP or WebP)",
                param=part.location,
                rejection=Rejection(model, "image", "invalid_content"),
            )
        return f"data:{mime};base64,{base64.b64encode(data).decode()}", data


@dataclass(frozen=True, slots=True)
class _Job:
    """What every image of one request is described for, how, and by whom."""

    plan: RoutePlan  # the requested model's
    policy: Policy  # its image policy: the prompt and on_error
    target: ModelConfig  # the describing model
    live: Generation[Pool]  # its pool and key, of the request's generation
    request_id: str
    spend: Callable[[str, Usage], None]  # what each answer cost (the describing model's name, its usage)


def _usage(reply: Mapping[str, Any]) -> Usage | None:
    fields = reply.get("usage")
    return usage_of(fields) if isinstance(fields, dict) else None


def _source(part: Mapping[str, Any]) -> str | None:
    """An image part's URL or data URL, whatever its API's shape: chat's ``image_url: {url}``,
    Responses' ``image_url: "..."``, Anthropic's ``source: {type: base64 | url}``; None for one
    that carries no image (embeddings, a file id)."""
    value = part.get("image_url")
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str) and value:
        return value
    source = part.get("source")
    if isinstance(source, dict):
        if source.get("type") == "base64" and isinstance(source.get("data"), str):
            return f"data:{source.get('media_type', 'image/png')};base64,{source['data']}"
        if source.get("type") == "url" and isinstance(source.get("url"), str):
            return str(source["url"])
    return None


def _content(reply: Mapping[str, Any]) -> str | None:
    """A chat completion's answer ("" for one with no text: null or blank content); None when
    the reply is not a chat completion."""
    try:
        message = reply["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(message, dict):
        return None
    text = message.get("content")
    return text.strip() if isinstance(text, str) else ""
