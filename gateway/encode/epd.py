"""Priming vLLM's own encoder instances (Encode/Prefill/Decode with vLLM's EC connector).

An encoder of ``kind: vllm`` is a set of encoder-only vLLM instances (``--ec-transfer-config``
with ``ec_role: ec_producer``): given a chat request holding media, each computes the
embeddings, stores them in the encoder cache under the media's hash, and answers without
generating. The model's upstreams are ``ec_consumer`` instances: they load cached embeddings
instead of encoding. This module does what must happen in between, the wire protocol of vLLM's
reference proxy (``examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py``):

- every image gets a content-derived ``uuid``, the sha256 of its bytes, which vLLM uses as the
  cache key (``multi_modal_uuids``); the same uuid goes to the encoder and to the consumer;
- identical images of a request are primed once; each image goes to the instance its uuid hashes
  to (bounded-load consistent hashing over the healthy instances: the same image, the same
  instance, whose cache then hits); images for one instance go together, ``max_batch_size`` to
  a request, as a text-free chat request (``stream: false``, the model's upstream name, the
  request's ``mm_processor_kwargs`` and ``media_io_kwargs``, without which both sides size images
  differently); the requests run concurrently, bounded;
- a failing instance (refused, reset, timed out, 5xx) is passed over: its images go to the next
  instance on the ring, until every instance was tried (then :class:`~gateway.errors.EncoderError`,
  which ``on_encoder_error`` turns into a passthrough or a 503);
- each reply's ``ec_transfer_params`` (per cached item: the key and the ``metadata`` the
  encoder's processor produced, e.g. ``image_grid_thw``) says how the consumer may refer to
  the item: :func:`parts_for_consumer` rewrites every primed part as a metadata-only reference
  (``{"type": "image_embeds", "image_embeds": {<metadata>}, "uuid": ...}``), so the pixels never
  travel twice. vLLM refuses a request that mixes raw images and embeddings, so when any image
  came back without metadata (an older vLLM, ``--mm-processor-cache-type shm``) every image goes
  as its original media, with its uuid (the consumer's connector still finds the cached
  embedding by it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from ..config import EncoderConfig
from ..errors import EncoderError, ImagesRefusedError, error_detail
from ..fanout import gather_all
from ..metrics import GatewayMetrics
from ..tracing import Tracing, inject
from ..upstream.attempts import Attempts, failed
from ..upstream.failures import CLIENT_ERRORS, being_cancelled, read_capped
from ..upstream.replicas import Lease, Pool, Replica

log = logging.getLogger(__name__)
JSON = "application/json"
# The request's fields an encoder instance must see to process images as the consumer will.
CARRIED_FIELDS = ("mm_processor_kwargs", "media_io_kwargs")
# What an encoder instance may answer, checked before anything of it goes on to the consumer: a
# priming reply is a chat completion with an ec_transfer_params entry per image (its cache key,
# its metadata such as image_grid_thw, its item_indices: ~200 bytes). Over these it is not an
# encoder the gateway can use (the images go to another instance): an entry nested 300 levels
# deep was a 500 (orjson writes at most 254), 3.9 MB of reply held the event loop for 348 ms,
# and one 3 MB entry shared by 8 images made a 27 MB consumer body of a 1 KB request.
MAX_ENTRY_BYTES = 8 << 10  # one item's entry, as written again
MAX_ENTRY_DEPTH = 8  # levels of nesting in one entry
MAX_KEY_CHARS = 256  # an entry's cache key


def max_reply_bytes(items: int) -> int:
    """The most a priming reply for ``items`` images may be: its entries and the rest of a chat
    completion (choices, usage)."""
    return (1 + items) * MAX_ENTRY_BYTES


@dataclass(frozen=True, slots=True)
class Priming:
    """One request's priming: over which session, on which encoder's instances (``pool``: its
    ring, of the request's generation), for which model, with which of the request's fields."""

    session: aiohttp.ClientSession
    spec: EncoderConfig
    pool: Pool
    upstream_model: str
    carried: Mapping[str, Any]  # CARRIED_FIELDS of the request
    request_id: str
    metrics: GatewayMetrics
    tracing: Tracing | None = None  # each priming request carries the prime span's traceparent


def carried(body: Mapping[str, Any]) -> dict[str, Any]:
    """The request's fields an encoder instance must see (:data:`CARRIED_FIELDS`)."""
    return {k: body[k] for k in CARRIED_FIELDS if k in body}


@dataclass(slots=True)
class Item:
    """One distinct image of a request, and its way through the instances."""

    uuid: str  # sha256 of its bytes
    url: str  # as the client sent it (a data URL, or an http(s) URL)
    attempts: Attempts  # its ring placement (by uuid), never an instance twice
    entry: dict[str, Any] | None = None  # its ec_transfer_params entry, once primed
    key: str = ""  # the entry's key: the cache key the encoder reported

    @classmethod
    def of(cls, priming: Priming, uuid: str, url: str) -> Item:
        # panic: with every instance's breaker open the first try goes anyway (one URL may be a fleet)
        return cls(uuid, url, Attempts(priming.pool, key=uuid.encode(), panic=True))


@dataclass(frozen=True, slots=True)
class Primed:
    """What priming gave: per uuid its entry, and the ``ec_transfer_params`` for the consumer."""

    entries: Mapping[str, dict[str, Any]]  # uuid -> the encoder's entry ({} when it reported none)
    transfer_params: dict[str, Any]  # key -> entry, as vLLM's proxy passes them on


async def prime(priming: Priming, items: list[Item], concurrency: int) -> Primed:
    """Prime every item on the instances of ``priming.spec`` (see the module docstring): each
    round sends every item still pending to the next instance its own attempts place it on, and
    ends when every item is primed, or one has no instance left to try."""
    spec, metrics = priming.spec, priming.metrics
    limit = asyncio.Semaphore(concurrency)
    pending = list(items)
    failure: str | None = None
    started = time.perf_counter()
    try:
        while pending:
            groups = _groups(pending, spec.max_batch_size)
            if groups is None:  # an image no instance is left to take: the request cannot be primed
                break
            # one lease a priming request (its load, and its outcome for the breaker), each given
            # back once whether or not its request ever started
            with contextlib.ExitStack() as leases:
                for g in groups:
                    g.lease = leases.enter_context(priming.pool.lease_on(g.replica))
                # an image refused, or the client left: the other primes stop too
                results = await gather_all(*(_limited(limit, priming, g) for g in groups))
            pending = [item for g, failed in zip(groups, results, strict=True) if failed for item in g.items]
            failure = next((f for f in results if f), failure)
    finally:
        metrics.encoder_seconds.labels(spec.name).observe(time.perf_counter() - started)
    if pending:
        metrics.encoder_requests.labels(spec.name, "unavailable").inc(len(pending))
        retry_after = {"Retry-After": str(priming.pool.retry_after())}
        detail = f": {failure}" if failure else ""
        raise EncoderError(f"Encoder '{spec.name}' could not prime the images on any instance{detail}",
                           headers=retry_after)  # fmt: skip
    entries = {item.uuid: item.entry or {} for item in items}
    params = {item.key: item.entry for item in items if item.entry}
    return Primed(entries, params)


def _groups(pending: list[Item], max_batch_size: int) -> list[_Group] | None:
    """The pending items by the instance each goes to next (placement alone: this request's own
    images must not push each other off their instances by the load bound), ``max_batch_size`` a
    group; None when one has no instance left."""
    groups: list[_Group] = []
    open_group: dict[str, _Group] = {}  # by instance URL: the group still taking images
    for item in pending:
        replica = item.attempts.place()
        if replica is None:
            return None
        group = open_group.get(replica.url)
        if group is None or len(group.items) >= max_batch_size:
            group = open_group[replica.url] = _Group(replica, [])
            groups.append(group)
        group.items.append(item)
    return groups


@dataclass(slots=True)
class _Group:
    replica: Replica
    items: list[Item]
    lease: Lease | None = None  # while its request is out


async def _limited(limit: asyncio.Semaphore, priming: Priming, group: _Group) -> str | None:
    """:func:`_send`, once one of the request's places is free (its coroutine made only then)."""
    async with limit:
        return await _send(priming, group)


def _headers(priming: Priming) -> dict[str, str]:
    headers = {"Content-Type": JSON, "X-Request-Id": priming.request_id}
    inject(priming.tracing, headers)
    return headers


async def _send(priming: Priming, group: _Group) -> str | None:
    """One priming request; None when it went through (each item's entry set), else why it failed
    (the items are tried on another instance). A 400 is the images' fault: raised."""
    spec, metrics = priming.spec, priming.metrics
    url = group.replica.url
    content = [{"type": "image_url", "image_url": {"url": item.url}, "uuid": item.uuid} for item in group.items]
    payload = {
        "model": priming.upstream_model,
        "messages": [{"role": "user", "content": content}],
        "stream": False,
        **priming.carried,
    }
    lease = group.lease  # one request: one outcome for the breaker
    assert lease is not None
    outcome = "error"
    started = time.perf_counter()
    try:
        try:
            async with priming.session.post(
                f"{url}/v1/chat/completions",
                data=orjson.dumps(payload),
                headers=_headers(priming),
                timeout=aiohttp.ClientTimeout(total=spec.timeout_s),
            ) as resp:
                status, data = resp.status, await read_capped(resp, max_reply_bytes(len(group.items)))
        except CLIENT_ERRORS as exc:
            why = failed(lease, exc, spec.name)
            outcome = "error" if why.kind in ("reset", "protocol") else why.outcome
            return why.reason
        if status not in (200, 400, 422):  # failing, overloaded, or not an encoder the gateway can use
            if status == 429:
                lease.busy(1.0)
            else:
                lease.failure(f"HTTP {status}")
            outcome = "overloaded" if status in (429, 503) else "error"
            log.warning("encoder %s instance %s answered %d", spec.name, url, status)
            return f"HTTP {status}"
        if status != 200:  # 400, 422: the instance refused the images, the client's fault
            lease.success()
            outcome = "invalid"
            raise ImagesRefusedError(
                f"encoder '{spec.name}' refused the image(s){error_detail(data)}",
                uuids=tuple(item.uuid for item in group.items),
            )
        unusable = _match(group.items, data)
        if unusable is not None:  # not what an encoder instance answers: its images go elsewhere
            lease.failure(unusable)
            log.warning("encoder %s instance %s: %s", spec.name, url, unusable)
            return unusable
        lease.success()
        outcome = "ok"
        return None
    finally:  # a request cancelled (the client left) is not counted: it says nothing of the instance
        if not being_cancelled():
            metrics.encoder_requests.labels(spec.name, outcome).inc(len(group.items))  # images
            metrics.child(metrics.encoder_backend_requests, spec.name, url, outcome).inc()
            metrics.child(metrics.encoder_backend_seconds, spec.name, url).observe(time.perf_counter() - started)


def _match(items: list[Item], data: bytes) -> str | None:
    """Set each item's entry from a reply's ``ec_transfer_params``, matched as vLLM's proxy does:
    by ``item_indices`` (positions in the request) when several went together, else by the uuid
    as key, else the one entry of a one-item request. An item left unmatched gets ``{}``. Says
    why when the reply is not one to pass on (nothing is set then)."""
    try:
        reply = orjson.loads(data)
    except orjson.JSONDecodeError:
        reply = None
    params = reply.get("ec_transfer_params") if isinstance(reply, dict) else None
    if not isinstance(params, dict):
        params = {}
    for key, entry in params.items():
        unusable = _unusable(key, entry)
        if unusable is not None:
            return f"a priming reply with an ec_transfer_params entry {unusable}"
    by_index: dict[int, tuple[str, dict[str, Any]]] = {}
    for key, entry in params.items():
        if not isinstance(entry, dict):
            continue
        indices = entry.get("item_indices")
        if isinstance(indices, list):
            for i in indices:
                if type(i) is int and 0 <= i < len(items) and i not in by_index:
                    by_index[i] = (key, entry)
    for i, item in enumerate(items):
        found = by_index.get(i)
        if found is None and isinstance(params.get(item.uuid), dict):
            found = (item.uuid, params[item.uuid])
        if found is None and len(items) == 1 and len(params) == 1:
            key, entry = next(iter(params.items()))
            if isinstance(entry, dict):
                found = (key, entry)
        if found is None:
            item.key, item.entry = item.uuid, {}
        else:
            item.key, item.entry = found
    return None


def _unusable(key: str, entry: Any) -> str | None:
    """Why an ``ec_transfer_params`` entry cannot go on to the consumer, or None."""
    if len(key) > MAX_KEY_CHARS:
        return f"key of {len(key)} characters (at most {MAX_KEY_CHARS})"
    if _depth(entry, MAX_ENTRY_DEPTH) > MAX_ENTRY_DEPTH:
        return f"nested over {MAX_ENTRY_DEPTH} levels"
    size = len(orjson.dumps(entry))
    if size > MAX_ENTRY_BYTES:
        return f"of {size} bytes (at most {MAX_ENTRY_BYTES})"
    return None


def _depth(value: Any, limit: int) -> int:
    """How deep ``value`` nests (a scalar: 0), counted no further than one past ``limit``."""
    if limit < 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(v, limit - 1) for v in children), default=0)


def plan(spec: EncoderConfig, images: list[tuple[str, str | None]]) -> dict[str, Any]:
    """The priming plan of a request's images, for ``modality-gateway explain``: per image (its
    location and uuid; None for a URL, fetched when served), the instance its uuid hashes to while
    every instance is healthy and idle (affinity; load and health move it when served)."""
    pool = Pool(spec.name, [Replica(u) for u in spec.urls], balance="affinity")
    placed = []
    for location, uuid in images:
        replica = pool.choose(key=uuid.encode()) if uuid is not None else None
        placed.append({"location": location, "uuid": uuid, "instance": replica.url if replica else None})
    return {"instances": list(spec.urls), "max_batch_size": spec.max_batch_size, "images": placed}


def metadata_of(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The metadata a consumer takes in place of the pixels (one level of nesting flattened, as
    vLLM's proxy does: ``[[1, 32, 48]]`` becomes ``[1, 32, 48]``), or None when the encoder gave none."""
    metadata = entry.get("metadata")
    if not isinstance(metadata, dict) or not metadata:
        return None
    flat: dict[str, Any] = {}
    for key, value in metadata.items():
        if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
            value = [x for sub in value for x in sub]
        flat[key] = value
    return flat


def parts_for_consumer(located: list[tuple[dict[str, Any], str]], primed: Primed) -> list[dict[str, Any]]:
    """The new part for each image part (with its uuid): a metadata-only ``image_embeds``
    reference when every image has metadata; else every image as the client sent it, with its
    uuid (vLLM refuses a request that mixes raw images and embeddings)."""
    metadata = {uuid: metadata_of(entry) for uuid, entry in primed.entries.items()}
    if all(m is not None for m in metadata.values()):
        return [{"type": "image_embeds", "image_embeds": metadata[uuid], "uuid": uuid} for _, uuid in located]
    return [{**part, "uuid": uuid} for part, uuid in located]
