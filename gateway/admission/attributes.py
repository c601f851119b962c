"""What a trace says of an admitted request (attributes of its span, gateway.tracing): the media
it holds, by modality, and each one's hash, never its content; its visual tokens. (Its route is
said as it goes upstream, after any conversion changed it: gateway.server.exchange.forward.)"""

from __future__ import annotations

import hashlib
from collections import Counter
from typing import Any

from ..modalities import Modality
from ..tracing import Attributes
from .route import RoutePlan


def admission_attributes(plan: RoutePlan, body: dict[str, Any]) -> Attributes:
    """Admission's attributes of a request's span: the media it holds, by modality, and each
    one's hash (never its content); its visual tokens."""
    held = Counter(p.modality.value for p in plan.classification.parts)
    attributes: dict[str, str | int | list[str]] = {f"gateway.media.{m}.count": n for m, n in sorted(held.items())}
    for modality, hashes in _media_hashes(plan, body).items():
        attributes[f"gateway.media.{modality}.sha256"] = hashes
    if plan.visual is not None:
        attributes["gateway.visual_tokens"] = plan.visual.tokens
    return attributes


def _media_hashes(plan: RoutePlan, body: dict[str, Any]) -> dict[str, list[str]]:
    """Each medium's sha256, by modality: of its URL or data as sent (a data URL's text), so that
    the same image, video or clip sent again has the same hash in every trace."""
    contents = plan.contents(body)
    found: dict[str, list[str]] = {}
    for part in plan.classification.parts:
        if part.modality is Modality.TEXT or part.index is None:
            continue
        value = contents[part.message].value
        sent = _payload(value[part.index]) if isinstance(value, list) and part.index < len(value) else None
        if sent:
            digest = hashlib.sha256(sent.encode("utf-8", "surrogatepass")).hexdigest()
            found.setdefault(part.modality.value, []).append(digest)
    return found


def _payload(part: Any, depth: int = 0) -> str | None:
    """The longest string of a part but its type (its URL or its data; a part nests them two
    deep at most)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict) or depth > 2:
        return None
    strings = [s for k, v in part.items() if k != "type" and (s := _payload(v, depth + 1))]
    return max(strings, key=len, default=None)
