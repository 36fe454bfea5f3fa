"""The shape of `src/treadle`'s imports (STYLE.md rule 7, issues 25 and 43): no cycle between
modules at run time (imports inside functions count), imports flow down the floors (cli ->
entrypoints -> frontend -> core -> executor -> worker -> model, the ground floor under all, in
its own order), and no module grows past MAX_LINES.

Read from the source with `ast`, so it costs no import. Every import that can run counts:
module-level ones (also inside `if`/`try`/`with`) and those inside functions and classes (they
run when called: a cycle through one is a cycle at run time), not those under
`if TYPE_CHECKING:`.

An edge A -> B means "importing A runs B": every module A names, and the packages above it
(their `__init__` runs first) except A's own packages (they are already being imported when A
runs: a package's `__init__` that imports its children is no cycle). `from P import x` names
the module `P.x` when there is one, else `P`.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

FLOORS = ["cli", "entrypoints", "frontend", "core", "executor", "worker", "model"]
"""Top to bottom: a module may import from its own floor and the floors below it."""
GROUND = "ground"
"""Everything else: the package itself (`treadle/__init__.py`, which every module runs), the
top-level modules (`config`, `engine_args`, `envs`, `logger`, `sampling_params`,
`validation`, `outputs`, `tokenizer`, `structured_outputs`) and the `ipc/` and `wire/`
packages. Every floor may use it; it imports nothing above itself."""

GROUND_FLOORS: list[tuple[str, ...]] = [
    ("treadle.engine_args",),
    ("treadle.vllm_args",),
    ("treadle.ipc",),
    ("treadle.wire",),
    (
        "treadle.config",
        "treadle.parallel_config",
        "treadle.tokenizer",
        "treadle.outputs",
        "treadle.prompt_embeds",
        "treadle.structured_outputs",
        "treadle.validation",
        "treadle.sampling_params",
        "treadle.checks",
    ),
    (
        "treadle.ipc.serial",
        "treadle.ipc.shm_message",
        "treadle.ipc.shm_ring",
        "treadle.ipc.tensor_ring",
        "treadle.ipc.cluster_auth",
        "treadle.ipc.engine_auth",
        "treadle.ipc.fast_exit",
    ),
    ("=treadle", "=treadle.ipc", "treadle.envs", "treadle.logger"),
]
"""The ground floor's own floors, top to bottom (a package prefix, or `=` and one module,
such as a package's own `__init__`; the longest match places a module): the CLI's flags over the transport (processes, sockets, the shm
broadcast) over the wire types over the values a request carries (config, sampling, the rules
on them) over the codec and the keys (serializer, shm rings, HMAC) over the environment and
the logger. A new ground module is placed here by hand."""

MAX_LINES = 450
"""No module of `src/treadle` is longer (STYLE.md rule 1: one idea per file)."""

# Known breaches in files that another change owns (issue 25, items 1 and 6); each names the
# file and why, so that change can delete its entry. Keep this list short.
ALLOWED_EDGES: set[tuple[str, str]] = set()
ALLOWED_LONG_FILES: dict[str, int] = {
    # Longer than MAX_LINES when the cap reached all of src/treadle (issue 43 item 5), each
    # with its length then plus 60 lines as its own cap (other changes were adding to them):
    # split one and delete its entry. Never add an entry.
}


@cache
def modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is its `__init__`)."""
    out = {}
    for path in sorted((SRC / "treadle").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(body: list[ast.stmt]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that can run: at module level, inside `if`/`try`/`with`, and inside
    functions and classes (an import in a function runs when it is called, and a cycle through
    it is a cycle all the same); not those under `if TYPE_CHECKING:`."""
    for node in body:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
            continue
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                if isinstance(child, ast.ExceptHandler | ast.match_case):
                    yield from _runtime_imports(child.body)
                elif isinstance(child, ast.stmt):
                    yield from _runtime_imports([child])


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@cache
def graph() -> dict[str, frozenset[str]]:
    """Module -> the modules of the package that importing it runs directly."""
    mods = modules()
    out = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        named: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                named.update(a.name for a in node.names)
                continue
            base = node.module or ""
            if node.level:  # relative: from the module's package upwards
                package = name.split(".") if is_package else name.split(".")[:-1]
                package = package[: len(package) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            for alias in node.names:
                named.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        edges = set()
        own = set(_ancestors(name)) | ({name} if is_package else set())
        for target in named:
            while target and target not in mods:  # `import treadle.x.y` of a package path
                target = target.rpartition(".")[0]
            if not target:
                continue  # not ours
            edges.update(m for m in [*_ancestors(target), target] if m not in own)
        edges.discard(name)
        out[name] = frozenset(edges)
    return out


def floor(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in FLOORS else GROUND


def ground_floor(name: str) -> int:
    """The index in GROUND_FLOORS of the longest prefix that holds `name`."""
    best, where = (-1, False), -1
    for i, names in enumerate(GROUND_FLOORS):
        for prefix in names:
            exact = prefix.startswith("=")
            prefix = prefix.removeprefix("=")
            holds = name == prefix or (not exact and name.startswith(prefix + "."))
            if holds and (len(prefix), exact) > best:
                best, where = (len(prefix), exact), i
    assert where >= 0, f"{name}: place it in GROUND_FLOORS"
    return where


def _height(name: str) -> int:
    f = floor(name)
    return len(FLOORS) - FLOORS.index(f) if f != GROUND else 0


def _cycles(g: dict[str, frozenset[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return [_one_cycle(g, set(c)) for c in components]


def _one_cycle(g: dict[str, frozenset[str]], component: set[str]) -> list[str]:
    """A shortest path from the component's first module back to itself."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(g[v] & component):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError("not a cycle")


def test_the_graph_sees_what_runs() -> None:
    g = graph()
    assert "treadle" in g and "treadle.frontend.async_llm" in g
    assert "treadle.config" in g["treadle.engine_args"]
    code = (
        "import x\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import y\n"
        "def f():\n    import z\ntry:\n    import w\nexcept ImportError:\n    pass\n"
        "class C:\n    def m(self):\n        if True:\n            import v\n"
    )
    names = [a.name for n in _runtime_imports(ast.parse(code).body) for a in n.names]
    assert names == ["x", "TYPE_CHECKING", "z", "w", "v"]


def test_the_package_loads_lazily() -> None:
    """`import treadle.envs` (every engine core and worker does) runs `treadle/__init__.py`,
    which loads no front end; `from treadle import LLM` still works."""
    code = (
        "import sys, treadle.envs\n"
        "assert not [m for m in sys.modules if m.startswith(('treadle.entrypoints', "
        "'treadle.frontend'))], sorted(sys.modules)\n"
        "from treadle import LLM, SamplingParams\n"
        "assert LLM.__module__ == 'treadle.entrypoints.llm'\n"
    )
    subprocess.run(
        [sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": str(SRC)}
    )


def test_no_import_cycles() -> None:
    cycles = [c for c in _cycles(graph()) if not set(zip(c, c[1:], strict=False)) <= ALLOWED_EDGES]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_flow_down_the_floors() -> None:
    upward = sorted(
        (a, b)
        for a, targets in graph().items()
        for b in targets
        if _height(b) > _height(a) and (a, b) not in ALLOWED_EDGES
    )
    assert not upward, "imports up a floor:\n" + "\n".join(
        f"{a} ({floor(a)}) -> {b} ({floor(b)})" for a, b in upward
    )


def test_the_ground_floor_keeps_its_order() -> None:
    """Inside the ground floor, imports flow down GROUND_FLOORS too (a module of the ground
    never imports one placed above it)."""
    ground = [m for m in graph() if floor(m) == GROUND]
    upward = sorted(
        (a, b)
        for a in ground
        for b in graph()[a]
        if floor(b) == GROUND and ground_floor(b) < ground_floor(a)
    )
    assert not upward, "ground imports up its floors:\n" + "\n".join(
        f"{a} -> {b}" for a, b in upward
    )


def test_allowed_edges_are_still_needed() -> None:
    """An allow-list entry that no longer happens is deleted with the fix."""
    g = graph()
    stale = sorted((a, b) for a, b in ALLOWED_EDGES if b not in g.get(a, ()))
    assert not stale, f"no longer imported, delete from ALLOWED_EDGES: {stale}"


def test_modules_are_short() -> None:
    long = {}
    for path in sorted((SRC / "treadle").rglob("*.py")):
        rel = path.relative_to(SRC / "treadle").as_posix()
        lines = len(path.read_text().splitlines())
        if lines > ALLOWED_LONG_FILES.get(rel, MAX_LINES):
            long[rel] = lines
    assert not long, f"over {MAX_LINES} lines (or an allowed file over its cap): {long}"
    stale = [
        f
        for f in ALLOWED_LONG_FILES
        if not (SRC / "treadle" / f).exists()
        or len((SRC / "treadle" / f).read_text().splitlines()) <= MAX_LINES
    ]
    assert not stale, f"short now, delete from ALLOWED_LONG_FILES: {stale}"
