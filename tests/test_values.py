"""``@record`` (gateway.values): frozen to the type checker, a slotted dataclass at run time that
compares and hashes by its compared fields as a frozen one does."""

from __future__ import annotations

import dataclasses

from gateway.admission.parts import Part
from gateway.modalities import Modality
from gateway.values import record


@record
class _Point:
    x: int
    y: int
    note: str = dataclasses.field(default="", compare=False)


def test_a_record_compares_and_hashes_by_its_fields() -> None:
    a, b = _Point(1, 2, "a"), _Point(1, 2, "b")  # note is not compared
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert _Point(1, 3) != a
    assert not hasattr(a, "__dict__")  # slotted


def test_replace_makes_a_changed_copy() -> None:
    a = _Point(1, 2)
    b = dataclasses.replace(a, y=5)
    assert (a.y, b.y) == (2, 5)


def test_the_request_values_are_records() -> None:
    part = Part(0, 1, "image_url", (Modality.IMAGE,), where="input")
    assert part == Part(0, 1, "image_url", (Modality.IMAGE,)) and {part: 1}[Part(0, 1, "image_url", (Modality.IMAGE,))]
    assert dataclasses.is_dataclass(part)
