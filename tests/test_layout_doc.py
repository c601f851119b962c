"""docs/architecture.md's layout table names every module of gateway/ in its package's row, and no
module that is not there (it named one that did not exist and omitted 22, when README held it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def table() -> dict[str, set[str]]:
    """The layout table's rows: package (``server``; ``""`` for the root) -> the names it says."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    body = page.split("| package | what it holds |", 1)[1].split("\n\n", 1)[0]
    rows: dict[str, set[str]] = {}
    for line in body.splitlines()[2:]:
        cells = line.split("|")
        package = cells[1].strip().strip("`").rstrip("/")
        said = re.findall(r"`([A-Za-z0-9_]+/?)`", re.sub(r"\([^()]*\)", "", cells[2]))  # not inside asides
        rows["" if package == "root" else package] = set(said)
    return rows


def tree() -> dict[str, set[str]]:
    """gateway/'s packages -> their modules (a sub-package with its slash)."""
    gateway = ROOT / "gateway"
    found: dict[str, set[str]] = {"": set()}
    for path in sorted(gateway.iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            found[path.name] = {
                p.stem if p.is_file() else f"{p.name}/"
                for p in path.iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p.is_dir() and (p / "__init__.py").exists())
            }
        elif path.suffix == ".py" and path.stem != "__init__":
            found[""].add(path.stem)
    return found


def test_the_layout_table_names_every_module_and_no_other() -> None:
    said, there = table(), tree()
    assert set(said) == set(there), "a package missing from the table, or named there but absent"
    for package, modules in there.items():
        assert said[package] == modules, (
            f"gateway/{package}: not named {sorted(modules - said[package])}, named but absent "
            f"{sorted(said[package] - modules)}"
        )
