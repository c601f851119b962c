"""The encoder backend's tests, and the gateway's tests that run it: they need the `encoder` extra
(torch, Pillow). Without it, this folder is skipped, saying so; the gateway's own tests still run."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="needs the encoder extra (torch): pip install -e '.[encoder]'")
pytest.importorskip("PIL", reason="needs the encoder extra (Pillow): pip install -e '.[encoder]'")

from tests.backends.fixtures import backend_factory  # noqa: F401 - a fixture for these tests
