"""A request's priority class: the ``x-priority`` header, capped by its API key.

The classes, highest first, are :data:`~gateway.config.PRIORITIES` (``system``, ``interactive``,
``default``, ``bulk``). A key's ``priority: {default, max}`` says the class its requests get
without the header and the highest one they may ask for: a request may lower its class, never
raise it above the cap (a higher one asked for is served at the cap, and ``X-Gateway-Priority``
says so). Without ``auth:`` there are no keys to grant the top class: requests get ``default``
and may ask for up to ``interactive``. The class orders a model's queue
(:mod:`gateway.upstream.concurrency`); it means nothing to a model without ``max_concurrency``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import PRIORITIES, ApiKey, PriorityCap
from ..errors import InvalidPriorityError

HEADER = "x-priority"
ANONYMOUS = PriorityCap(default="default", max="interactive")  # auth off: no key grants system
_RANKS = {name: rank for rank, name in enumerate(PRIORITIES)}
DEFAULT_RANK = _RANKS["default"]  # a request's without a key or the header


def check_engine_priority(body: Mapping[str, Any], key: ApiKey | None) -> None:
    """400 ``invalid_priority`` for a body's own ``priority`` (vLLM's and SGLang's scheduling
    priority, which the engine acts on as sent) from a key that may not ask for ``system``: one
    capped at ``bulk`` sent ``"priority": -1000`` and went first. Which way is more urgent is the
    engine's to say (vLLM: lower; SGLang: higher, unless told otherwise), so the gateway cannot
    cap the number: it lets it through only from the keys it trusts with the top class. Without
    ``auth:`` every client is the same: the body goes as sent."""
    if key is None or key.priority.max == "system":
        return
    value = body.get("priority")
    if value is None or value == 0:
        return
    raise InvalidPriorityError(
        f"'priority' in the body is the engine's own scheduling priority, which key '{key.name}' may not set "
        f"(its class is capped at '{key.priority.max}'): ask for a class with the {HEADER} header",
        param="priority",
    )


def priority_of(header: str | None, cap: PriorityCap) -> int:
    """The request's class, as its rank in PRIORITIES (0 the highest); 400 ``invalid_priority``
    for a header that names no class."""
    if header is None or not (asked := header.strip().lower()):
        return _RANKS[cap.default]
    rank = _RANKS.get(asked)
    if rank is None:
        raise InvalidPriorityError(
            f"Unknown priority class {header[:40]!r} in the {HEADER} header (expected one of: {', '.join(PRIORITIES)})"
        )
    return max(rank, _RANKS[cap.max])
