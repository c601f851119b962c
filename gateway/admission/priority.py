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

from ..config import PRIORITIES, PriorityCap
from ..errors import InvalidPriorityError

HEADER = "x-priority"
ANONYMOUS = PriorityCap(default="default", max="interactive")  # auth off: no key grants system
_RANKS = {name: rank for rank, name in enumerate(PRIORITIES)}
DEFAULT_RANK = _RANKS["default"]  # a request's without a key or the header


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
