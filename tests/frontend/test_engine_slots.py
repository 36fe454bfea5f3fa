"""One record per engine rank (`EngineSlot`), written only by the engine-life state machine
(`frontend/engine_restarts.py`): every other module of `src/treadle` reads it. Checked by
reading the code (`ast`), as `tests/test_imports.py` checks the floors.

A write is an assignment to a field of something that is a slot (an expression that names a
slot: `slot.state = ...`, `restarts.slots[r].pid = ...`, or a name bound from one: `for s in
restarts.slots: s.stalled = ...`), `setattr` on one, or a call that changes a field in place
(`slot.staged.append(...)`, `slot.up.set()`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from treadle.frontend.engine_state import EngineSlot

SRC = Path(__file__).resolve().parents[2] / "src" / "treadle"
OWNER = SRC / "frontend" / "engine_restarts.py"
FIELDS = {f.name for f in dataclasses.fields(EngineSlot)}
MUTATORS = {"append", "appendleft", "extend", "clear", "pop", "popleft", "remove", "set"}


def _names_a_slot(node: ast.AST, aliases: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and (sub.id in aliases or "slot" in sub.id.lower()):
            return True
        if isinstance(sub, ast.Attribute) and "slot" in sub.attr.lower():
            return True
    return False


def _bound_names(target: ast.AST) -> list[str]:
    """The names a target binds (`x`, `a, b`), not those it only reads (`self.a[x] = ...`)."""
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _bound_names(elt)]
    if isinstance(target, ast.Starred):
        return _bound_names(target.value)
    return []


def _aliases(tree: ast.AST) -> set[str]:
    """Names bound from an expression that names a slot (`slot = self.slots[r]`, `for s in
    slots`), to a fixed point."""
    aliases: set[str] = set()
    while True:
        before = len(aliases)
        for node in ast.walk(tree):
            pairs: list[tuple[ast.AST, ast.AST]] = []
            if isinstance(node, ast.Assign):
                pairs = [(t, node.value) for t in node.targets]
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                pairs = [(node.target, node.iter)]
            elif isinstance(node, ast.NamedExpr):
                pairs = [(node.target, node.value)]
            for target, value in pairs:
                if _names_a_slot(value, aliases):
                    aliases.update(_bound_names(target))
        if len(aliases) == before:
            return aliases


def slot_writes(source: str) -> list[str]:
    """Each write to a slot's field in `source`: "line N: what"."""
    tree = ast.parse(source)
    aliases = _aliases(tree)
    found: list[str] = []

    def field_of_slot(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr in FIELDS
            and _names_a_slot(node.value, aliases)
        )

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = node.targets
        for target in targets:
            for sub in ast.walk(target):
                if field_of_slot(sub) or (
                    isinstance(sub, ast.Subscript) and field_of_slot(sub.value)
                ):
                    found.append(f"line {node.lineno}: {ast.unparse(target)}")
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name) and func.id in ("setattr", "delattr") and node.args:
                name = node.args[1] if len(node.args) > 1 else None
                field = isinstance(name, ast.Constant) and name.value in FIELDS
                if _names_a_slot(node.args[0], aliases if field else set()):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
            elif (
                isinstance(func, ast.Attribute)
                and func.attr in MUTATORS
                and field_of_slot(func.value)
            ):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_only_the_state_machine_writes_an_engine_slot() -> None:
    writes = {
        str(path.relative_to(SRC)): found
        for path in sorted(SRC.rglob("*.py"))
        if path != OWNER and (found := slot_writes(path.read_text(encoding="utf-8")))
    }
    assert writes == {}, f"only {OWNER.name} may write an EngineSlot's fields: {writes}"


def test_the_state_machine_does_write_them() -> None:
    """(The check sees the writes where they are.)"""
    found = slot_writes(OWNER.read_text(encoding="utf-8"))
    assert any("state" in w for w in found) and any("staged" in w for w in found), found


def test_each_kind_of_write_is_seen() -> None:
    """Negative controls: each way of writing a slot's field is reported; reads are not."""
    writes = [
        "slot.state = EngineState.LOST",
        "self.restarts.slots[rank].pid = 7",
        "for s in client.restarts.slots:\n    s.stalled = True",
        "slot = restarts.slots[0]\nslot.last_progress += 1.0",
        "restarts.slots[0].staged.append('r')",
        "slot.up.set()",
        "setattr(restarts.slots[0], 'state', 'up')",
        "a, slot.kill_cause = 1, 'why'",
    ]
    for source in writes:
        assert slot_writes(source), source
    reads = [
        "state = restarts.slots[0].state",
        "x = [s.pid for s in restarts.slots]",
        "self.state = 'up'  # (not a slot)",
        "event.set()",
    ]
    for source in reads:
        assert not slot_writes(source), source
