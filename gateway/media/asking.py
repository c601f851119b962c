"""One request to a model of the table on a conversion's behalf: a transcript, a description.

The request goes through the model's pool as its own requests do (its choice of replica,
breakers, API key and timeouts; ``retries.attempts`` more tries within the model's retry budget,
a refused connection free; all within ``timeouts.total_s``), and the caller judges each answer:
a value, the medium's own fault (an error it raises: not retried; the replica did its job),
or a failed answer (:class:`Failed`: tried on the next replica, or not at all when ``final``).
When no replica gave a value, :class:`GaveUp` says why, and the caller tells its client in its
own words.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
import orjson

from ..admission.parts import Part
from ..admission.plan import EXPAND, removed_note
from ..admission.route import RoutePlan
from ..config import ModelConfig
from ..config.generation import Generation
from ..errors import GatewayError, Rejection, UnsupportedModalityError, UpstreamError, UpstreamTimeoutError
from ..fanout import gather_all
from ..metrics import GatewayMetrics
from ..tracing import Tracing, inject
from ..upstream.attempts import Attempts
from ..upstream.failures import CLIENT_ERRORS
from ..upstream.replicas import Pool
from ..upstream.retries import RetryBook
from ..upstream.wire import KEEPALIVE_S
from .conversions import ConversionCache
from .fetch import MediaFetcher

log = logging.getLogger(__name__)
T = TypeVar("T")
CONCURRENCY = 4  # parts of one request converted at once
Replacements = dict[tuple[int, int], dict[str, Any]]
CONVERSIONS = {"transcribe": "transcription", "describe": "description"}  # what a failure names
DROPPED = "__gateway_dropped__"  # marks the replacement of a part dropped under on_error: strip
MEDIA_FAULTS = (400, 413, 415, 422)  # statuses that say the medium is at fault: not retried
Post = Callable[[str, float | None], Awaitable[tuple[int, bytes]]]  # (replica URL, seconds left) -> status, body


class Asker:
    """What a conversion that asks models of the table needs: the gateway's metrics, its media
    fetcher, the models' retry budgets (the ones their own requests share), the conversions
    cache, the tracer, and a ClientSession of its own (:meth:`start`, :meth:`close`)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        fetcher: MediaFetcher,
        retries: RetryBook,
        cache: ConversionCache | None = None,
        *,
        tracing: Tracing | None = None,
    ) -> None:
        self._metrics = metrics
        self._fetcher = fetcher
        self._retries = retries
        self._cache = cache if cache is not None else ConversionCache(0)
        self._tracing = tracing  # each request it makes carries its stage's traceparent
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # connections let go before the engine's uvicorn closes them (5 s idle), as for chat requests
        connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S)
        self._session = aiohttp.ClientSession(connector=connector, cookie_jar=aiohttp.DummyCookieJar())

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def each_part(
        self,
        plan: RoutePlan,
        body: dict[str, Any],
        parts: tuple[Part, ...],
        convert: Callable[[Mapping[str, Any], Part], Awaitable[str]],
        *,
        marked: str,
    ) -> Replacements:
        """Each of ``parts`` (of one modality, which its policy converts) replaced by a
        text part of the request's API: ``marked`` and ``convert``'s text, CONCURRENCY at a
        time; a part the medium's fault refuses stops the others at once. When the model of the
        table could not answer, the policy's ``on_error``: ``fail``, the 502/504 at the part;
        ``reject``, the 400 a rejection would have been; ``strip``, the part dropped (counted and
        said by the exchange: :func:`dropped`)."""
        if not parts:
            return {}
        modality = parts[0].modality
        policy = plan.model.policy(modality)
        doing = CONVERSIONS.get(policy.action, policy.action)
        limit = asyncio.Semaphore(CONCURRENCY)
        contents = plan.contents(body)  # where the request keeps its parts (its API's view)
        model = plan.model.name

        async def one(part: Part) -> tuple[tuple[int, int], dict[str, Any]]:
            assert part.index is not None
            at = (part.message, part.index)
            async with limit:
                try:
                    text = await convert(contents[part.message].value[part.index], part)
                except (UpstreamError, UpstreamTimeoutError) as exc:
                    if policy.on_error == "strip":
                        log.warning("model %s: %s not converted, dropped (%s)", model, part.location, exc.message)
                        note = removed_note(modality, model, doing)
                        return at, {
                            "type": EXPAND,
                            "parts": [{"type": plan.api.text_part, "text": note}],
                            DROPPED: True,
                        }
                    if policy.on_error != "reject":
                        raise
                    raise UnsupportedModalityError(
                        f"Model '{model}' does not accept {modality} input, and its {doing} failed: "
                        f"{part.location} is '{part.type}' ({exc.message})",
                        param=part.location,
                        rejection=Rejection(model, modality.value, "unsupported"),
                    ) from None
            return at, {"type": plan.api.text_part, "text": marked + text}

        return dict(await gather_all(*(one(p) for p in parts)))

    def headers(self, target: ModelConfig, live: Generation[Pool], request_id: str, **more: str) -> dict[str, str]:
        """:func:`engine_headers` of a request this asker makes."""
        return engine_headers(self._tracing, target, live, request_id, **more)


def engine_headers(
    tracing: Tracing | None, target: ModelConfig, live: Generation[Pool], request_id: str, **more: str
) -> dict[str, str]:
    """The headers of a request the gateway makes of ``target``'s replicas for a client's (a
    conversion's question, a realtime session's upgrade): the client request's id, the trace
    context, and the model's API key (``api_key_env``) where it has one."""
    headers = {"X-Request-Id": request_id, **more}
    inject(tracing, headers)
    auth = live.upstream_auth.get(target.name)
    if auth is not None:
        headers["Authorization"] = auth
    return headers


@dataclass(frozen=True, slots=True)
class Failed:
    """An answer that is not a value: ``why`` (for the breaker and the client); ``final``: the
    model's own answer (no text), not the replica's failure: neither marked nor tried again."""

    why: str
    final: bool = False


class GaveUp(Exception):
    """No replica gave a value: why the last one did not, and whether time ran out."""

    def __init__(self, why: str, timed_out: bool) -> None:
        super().__init__(why)
        self.why, self.timed_out = why, timed_out


def json_object(data: bytes) -> dict[str, Any] | None:
    """A reply as the JSON object it should be, or None."""
    try:
        reply = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return reply if isinstance(reply, dict) else None


def dropped(replacements: Mapping[tuple[int, int], Mapping[str, Any]]) -> int:
    """The parts :meth:`Asker.each_part` dropped (``on_error: strip``)."""
    return sum(1 for part in replacements.values() if part.get(DROPPED))


def gave_up_error(gave_up: GaveUp, location: str, *, late: str, failed: str) -> UpstreamError:
    """The client's error at the part for a conversion no replica made: 504 ``upstream_timeout``
    (``late``) when time ran out, else 502 ``upstream_error`` (``failed``); each with why."""
    if gave_up.timed_out:
        return UpstreamTimeoutError(f"{location}: {late} ({gave_up.why})", param=location)
    return UpstreamError(f"{location}: {failed} ({gave_up.why})", param=location)


async def ask(
    target: ModelConfig,
    live: Generation[Pool],
    retries: RetryBook,
    post: Post,
    judge: Callable[[int, bytes], T | Failed],
    *,
    again_after_timeout: bool = True,
) -> T:
    """``judge``'s value for the first answer that has one, from one of ``target``'s replicas.
    ``again_after_timeout``: a try that timed out is made on the next replica (a conversion is
    idempotent and short); False for a generation, which would be made twice."""
    t = target.timeouts
    attempts = Attempts(
        live.pools[target.name],
        retries=retries.of(target),
        panic=True,
        deadline=asyncio.get_running_loop().time() + t.total_s if t.total_s else None,
    )
    why, timed_out = "no replica admits a request", False
    while (lease := await attempts.next()) is not None:
        with lease:
            try:
                status, data = await post(lease.replica.url, attempts.left())
            except CLIENT_ERRORS as exc:
                failure = attempts.failed(lease, exc)
                why, timed_out = failure.reason, failure.kind == "timeout"
                if timed_out and not again_after_timeout:
                    break
                if attempts.again(failure.outcome, free=failure.kind == "connect"):
                    continue  # the next replica, after a timeout too: a conversion is idempotent
                break
            try:
                verdict = judge(status, data)
            except GatewayError:  # the medium's fault: the replica did its job
                lease.success()
                raise
            if isinstance(verdict, Failed):
                why, timed_out = verdict.why, False
                if verdict.final:
                    lease.success()
                    break
                if status != 429:  # busy is not failing
                    lease.failure(verdict.why)
                if attempts.again(f"http_{status}"):
                    continue
                break
            lease.success()
            return verdict
    if attempts.expired:
        why, timed_out = f"timeouts.total_s of {t.total_s:g}s spent", True
    raise GaveUp(why, timed_out)
