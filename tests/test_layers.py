"""The gateway's packages name the stages of a request, and imports run one way only: from a stage
to the stages below it, never sideways or up (the order gateway/__init__.py gives).

Read from the code with ``ast``, as the torch guard reads it from a live import: every
``import`` and ``from ... import`` of every module, relative or absolute, at any depth (under
``if TYPE_CHECKING:`` too: a type names what a module knows of)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parent.parent / "gateway"
# top to bottom; a stage imports only those after it (and itself)
STAGES = ("server", "encode", "media", "upstream", "admission", "config")
ROOT = ("errors", "fanout", "metrics", "modalities")  # beneath every stage, importing none of them


def _layer(module: str) -> int:
    """The rank of a gateway-relative module: 0 is the top."""
    head = module.split(".")[0]
    if head in ("__main__", "__init__", ""):  # the package itself, and `python -m gateway`
        return -1
    if head in STAGES:
        return STAGES.index(head)
    assert head in ROOT, f"gateway/{head} is neither a stage ({', '.join(STAGES)}) nor a root module"
    return len(STAGES)


def _imports(source: str, package: list[str]) -> list[tuple[int, str]]:
    """(line, gateway-relative module) for every import of a gateway module in ``source``, a
    module of gateway's ``package``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = [*base, *(node.module.split(".") if node.module else [])]
                if node.module is None:  # from . import a: each a module of that package
                    found += [(node.lineno, ".".join([*target, a.name])) for a in node.names]
                    continue
                found.append((node.lineno, ".".join(target)))
            elif node.module and node.module.split(".")[0] == "gateway":
                found.append((node.lineno, node.module.removeprefix("gateway").removeprefix(".")))
        elif isinstance(node, ast.Import):
            found += [
                (node.lineno, a.name.removeprefix("gateway.")) for a in node.names if a.name.startswith("gateway.")
            ]
    return found


MODULES = sorted(p for p in GATEWAY.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(GATEWAY)))
def test_imports_run_down_the_stages_only(path: Path) -> None:
    module = ".".join(path.relative_to(GATEWAY).with_suffix("").parts)
    rank = _layer(module)
    wrong = []
    for line, target in _imports(path.read_text(), list(path.relative_to(GATEWAY).parent.parts)):
        if target.split(".")[0] == module.split(".")[0] and rank < len(STAGES):  # within its own stage
            continue
        if _layer(target) <= rank:
            wrong.append(f"gateway/{path.relative_to(GATEWAY)}:{line}: imports gateway.{target}")
    assert not wrong, "imports that run up or sideways:\n" + "\n".join(wrong)


def test_every_module_belongs_to_a_stage_or_the_root() -> None:
    for path in MODULES:
        parts = path.relative_to(GATEWAY).with_suffix("").parts
        if parts in (("__init__",), ("__main__",)):
            continue
        _layer(".".join(parts))


def test_the_walk_sees_every_kind_of_import() -> None:
    """Relative imports at any depth, absolute ones, and those under TYPE_CHECKING."""
    source = (
        "from typing import TYPE_CHECKING\nfrom ..server.state import Services\nimport gateway.media.video\n"
        "from . import relay\nif TYPE_CHECKING:\n    from ..encode import client\n"
    )
    found = [t for _, t in _imports(source, ["upstream"])]
    assert found == ["server.state", "media.video", "upstream.relay", "encode"]
    assert [_layer(t) for t in found] == [0, 2, 3, 1]
