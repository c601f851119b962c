"""YAML with marks: every value of routing.yaml keeps its line and column, so that a problem found
anywhere later can be reported as ``FILE:LINE:COL: dotted.path: message``. Aliases that expand
without end (alias bombs, recursive aliases) are refused cleanly."""

from __future__ import annotations

from typing import Any

import yaml

from ..errors import ConfigProblem

# A routing table is a few thousand values at most; aliases can make a small file expand to billions.
MAX_VALUES = 200_000


class TooLargeError(Exception):
    pass


class _Missing:
    pass


MISSING: Any = _Missing()


class MarkedDocument:
    """YAML nodes to Python values, keeping the mark of each; problems collected with their place."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.problems: list[ConfigProblem] = []
        self.value_marks: dict[str, yaml.Mark] = {}
        self.key_marks: dict[str, yaml.Mark] = {}
        self._scalars = yaml.SafeLoader("")
        self.values = 0

    # --- locations -------------------------------------------------------------------------

    def problem(self, path: str, message: str, *, at_key: bool = False, mark: yaml.Mark | None = None) -> None:
        mark = mark or (self.key_marks.get(path) if at_key else None) or self._nearest_mark(path)
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        self.problems.append(ConfigProblem(self.filename, line, col, path, message))

    def _nearest_mark(self, path: str) -> yaml.Mark | None:
        while True:
            if path in self.value_marks:
                return self.value_marks[path]
            if not path:
                return None
            cut = max(path.rfind("."), path.rfind("["))
            path = path[: max(cut, 0)]

    def to_python(self, node: yaml.Node, path: str) -> Any:
        self.values += 1
        if self.values > MAX_VALUES:
            raise TooLargeError(f"more than {MAX_VALUES} values (aliases that expand without end?)")
        self.value_marks[path] = node.start_mark
        if isinstance(node, yaml.SequenceNode):
            return [self.to_python(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
        if isinstance(node, yaml.MappingNode):
            explicit, merged = self._pairs(node, path)
            result: dict[str, Any] = {}
            first_seen: dict[str, yaml.Mark] = {}
            for key_node, value_node, is_merged in [(k, v, False) for k, v in explicit] + [
                (k, v, True) for k, v in merged
            ]:
                key = self._construct_scalar(key_node, path) if isinstance(key_node, yaml.ScalarNode) else None
                if not isinstance(key, str):
                    self.problem(path, "mapping keys must be strings", mark=key_node.start_mark)
                    continue
                if key in first_seen:
                    if not is_merged:  # an explicit key overrides a merged one, as YAML says
                        line = first_seen[key].line + 1
                        self.problem(
                            join_path(path, key),
                            f"duplicate key '{key}' (first at line {line})",
                            mark=key_node.start_mark,
                        )
                    continue
                child = join_path(path, key)
                self.key_marks.setdefault(child, key_node.start_mark)
                first_seen[key] = key_node.start_mark
                result[key] = self.to_python(value_node, child)
            return result
        return self._construct_scalar(node, path)

    def _pairs(
        self, node: yaml.MappingNode, path: str
    ) -> tuple[list[tuple[yaml.Node, yaml.Node]], list[tuple[yaml.Node, yaml.Node]]]:
        """A mapping's own key/value pairs, and those it merges in with ``<<`` (YAML merge keys)."""
        explicit: list[tuple[yaml.Node, yaml.Node]] = []
        merged: list[tuple[yaml.Node, yaml.Node]] = []
        for key_node, value_node in node.value:
            if key_node.tag != "tag:yaml.org,2002:merge":
                explicit.append((key_node, value_node))
                continue
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    self.problem(path, "'<<' merges a mapping or a list of mappings", mark=source.start_mark)
                    continue
                own, inherited = self._pairs(source, path)
                merged.extend(own + inherited)
        return explicit, merged

    def _construct_scalar(self, node: yaml.Node, path: str) -> Any:
        try:
            return self._scalars.construct_object(node)
        except yaml.YAMLError as exc:  # an unknown tag, a malformed timestamp, ...
            problem = getattr(exc, "problem", None) or str(exc)
            self.problem(path, f"cannot read this value: {problem}", mark=node.start_mark)
            return None


def join_path(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
