"""Reading a fleet file's YAML: safe_load with the bounds a few-KB configuration file should obey.

Bounds on the file itself: a fleet file is a few KB; anything past these is a mistake or an attack
(a YAML alias bomb expands to billions of values, deep nesting overflows the parser's stack, and
PyYAML keeps the last of two duplicate keys without a word). Errors are yaml.YAMLError (with a
mark: line and column) or ValueError; core/fleet.py turns both into one-line FleetErrors.
"""

from __future__ import annotations

from typing import Any

import yaml

from spark_pipelines.core import names

MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 32
MAX_VALUES = 100_000
# No fleet number needs more digits than this; Python refuses to read an integer of over 4300
# digits at all (a ValueError that names no field), so such a scalar is refused by its place.
MAX_INT_CHARS = 100
INT_TAG = "tag:yaml.org,2002:int"


class HugeNumber(ValueError):
    """An integer with more digits than any fleet setting takes, named by where it is."""

    def __init__(self, loc: tuple[Any, ...], chars: int, line: int) -> None:
        super().__init__(f"a number of {chars} characters at line {line}")
        self.loc, self.chars, self.line = loc, chars, line


class _FleetLoader(yaml.SafeLoader):
    """safe_load, plus: duplicate keys refused (PyYAML keeps the last one silently) and nesting bounded."""

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = self.construct_object(key_node)
                if key in first:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {names.shown(key)} (first at line {first[key]}); keep one",
                        key_node.start_mark)
                first[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def _expanded_size(root: Any) -> int:
    """Values the node graph expands to once aliases are resolved (memoized: a bomb is cheap to size)."""
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    active: set[int] = set()
    while stack:
        node, done = stack.pop()
        if id(node) in sizes:
            continue
        kids = [] if isinstance(node, yaml.ScalarNode) else (
            [x for kv in node.value for x in kv] if isinstance(node, yaml.MappingNode) else list(node.value))
        if done:
            active.discard(id(node))
            sizes[id(node)] = min(MAX_VALUES + 1, 1 + sum(sizes.get(id(k), 0) for k in kids))
            continue
        if id(node) in active:
            raise ValueError("a YAML alias refers to the value that contains it; write the value out")
        active.add(id(node))
        stack.append((node, True))
        for k in kids:
            if id(k) in active:
                raise ValueError("a YAML alias refers to the value that contains it; write the value out")
            if id(k) not in sizes:
                stack.append((k, False))
    return sizes[id(root)]


def _huge_int(root: Any) -> HugeNumber | None:
    """The first integer scalar too long to be any setting, with its key path (aliases were sized
    already: this walk visits each node once)."""
    stack: list[tuple[Any, tuple[Any, ...]]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, loc = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag == INT_TAG and len(node.value) > MAX_INT_CHARS:
                return HugeNumber(loc, len(node.value), node.start_mark.line + 1)
        elif isinstance(node, yaml.MappingNode):
            for k, v in reversed(node.value):
                stack += [(v, (*loc, k.value if isinstance(k, yaml.ScalarNode) else "?")), (k, loc)]
        else:
            stack += [(v, (*loc, i)) for i, v in reversed(list(enumerate(node.value)))]
    return None


def load_yaml(text: str) -> Any:
    loader = _FleetLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_VALUES:
            raise ValueError(f"YAML anchors/aliases expand to more than {MAX_VALUES} values; write the file out plainly")
        huge = _huge_int(node)
        if huge is not None:
            raise huge
        return loader.construct_document(node)
    finally:
        loader.dispose()
