"""``@record``: a request's values (its parts, their sizes, its plan, its dispatch) as frozen
dataclasses to the type checker, plain slotted ones at run time.

A frozen dataclass sets each field through ``object.__setattr__`` in its ``__init__``: an 8-field
one takes ~1.3 µs to make, a plain slotted one ~0.25 µs (Python 3.11), and a request makes a
dozen of them (bench/calls.py counts). ``mypy --strict`` (``make check``) sees these classes as
frozen (``dataclass_transform(frozen_default=True)``) and refuses any assignment to a field, so
the code keeps them immutable where it is checked; at run time they compare and hash by their
fields as frozen ones do (``unsafe_hash``), so they stay fit for sets and dict keys.
``dataclasses.replace`` makes a changed copy of either. Config stays frozen at run time too
(gateway.config: made once a reload, never a request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar, dataclass_transform

T = TypeVar("T")


@dataclass_transform(frozen_default=True, eq_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """``@dataclass(frozen=True, slots=True)`` to the type checker; slotted, compared and hashed
    by its fields at run time (the module's docstring)."""
    return dataclass(slots=True, unsafe_hash=True)(cls)
