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
ROOT = ("errors", "fanout", "metrics", "modalities", "tracing", "values")  # beneath every stage, importing none
# beneath the root: the metric types gateway.metrics declares its metrics with, the OTLP gateway.tracing sends
BOTTOM = ("meters", "otlp")


def _layer(module: str) -> int:
    """The rank of a gateway-relative module: 0 is the top."""
    head = module.split(".")[0]
    if head in ("__main__", "__init__", ""):  # the package itself, and `python -m gateway`
        return -1
    if head in STAGES:
        return STAGES.index(head)
    if head in BOTTOM:
        return len(STAGES) + 1
    assert head in ROOT, f"gateway/{head} is neither a stage ({', '.join(STAGES)}) nor a root module"
    return len(STAGES)


def _imports(source: str, package: list[str], top: str = "gateway") -> list[tuple[int, str]]:
    """(line, ``top``-relative module) for every import of a module of ``top`` (gateway, or
    backends.vision_encoder) in ``source``, a module of its ``package``."""
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
            elif node.module and (node.module == top or node.module.startswith(f"{top}.")):
                found.append((node.lineno, node.module.removeprefix(top).removeprefix(".")))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name.removeprefix(f"{top}.")) for a in node.names if a.name.startswith(f"{top}.")]
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


BACKEND = GATEWAY.parent / "backends" / "vision_encoder"


def _graph(root: Path = GATEWAY, top: str = "gateway") -> dict[str, set[str]]:
    """Every module under ``root`` and the modules of it that it imports (a package: its ``__init__``)."""
    names = {".".join(p.relative_to(root).with_suffix("").parts): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = list(path.relative_to(root).parent.parts)
        targets = set()
        for _, target in _imports(path.read_text(), package, top):
            if target in names:
                targets.add(target)
            elif f"{target}.__init__" in names:
                targets.add(f"{target}.__init__")
        graph[name] = targets - {name}
    return graph


@pytest.mark.parametrize(("root", "top"), [(GATEWAY, "gateway"), (BACKEND, "backends.vision_encoder")],
                         ids=["gateway", "backends"])  # fmt: skip
def test_no_module_imports_one_that_imports_it_back(root: Path, top: str) -> None:
    """No circle of imports, not even one for types only (what a module needs of another that
    needs it is a Protocol of its own), and none through a package's ``__init__`` but those of
    the package re-exporting its own modules; in gateway/ and in the encoder backend alike."""
    graph = _graph(root, top)
    circles = []
    for start in graph:
        stack = [(start, [start])]
        seen = set()
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "import circles:\n" + "\n".join(sorted(circles))


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = node.args
    names = [x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]]
    if names and names[0] in ("self", "cls"):
        names = names[1:]
    return len(names) + (a.vararg is not None) + (a.kwarg is not None)


def test_no_function_takes_more_than_six_parameters() -> None:
    """State one request has travels in an object (the exchange, the dispatch, a job), not in
    long parameter lists."""
    long = [
        f"gateway/{path.relative_to(GATEWAY)}:{node.lineno}: {node.name} takes {_parameters(node)}"
        for path in MODULES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and _parameters(node) > 6
    ]
    assert not long, "\n".join(long)


def test_one_attempt_loop_takes_every_lease_a_pool_chooses() -> None:
    """Replica choice is the attempt loop's (gateway/upstream/attempts.py): no other module asks a
    pool to choose and lease (a try loop of its own)."""
    elsewhere = [
        f"gateway/{path.relative_to(GATEWAY)}:{node.lineno}"
        for path in MODULES
        if path.name not in ("attempts.py", "replicas.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "lease"
    ]
    assert not elsewhere, "leases taken outside the attempt loop:\n" + "\n".join(elsewhere)


def test_only_admission_reads_a_body_whose_images_are_held_back() -> None:
    """``Exchange.parsed`` is the body with its images' data URLs cut to their first characters
    (gateway.admission.strings): only admission may read it, handed it by a door (or a top-level
    field the exchange reads as parsed); every other stage reads ``Exchange.body``, whole."""
    readers = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "parsed":
                readers.append(f"{path.relative_to(GATEWAY)}:{node.lineno}")
    allowed = ("server/exchange.py", "server/doors.py")  # a door hands it to lookup, admit, an affinity key
    assert [r for r in readers if not r.startswith(allowed)] == []
