"""The package's layers: each imports only those below it, no import circles, torch only where needed.

Every ``import`` and ``from ... import`` in the source counts, the ones inside functions (lazy
imports) included, so that a circle cannot hide behind a deferred import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# lowest first; a module may import its own layer and the layers below it
LAYERS = [
    ["sfchat", "sfchat.plaintext", "sfchat.events", "sfchat.tally", "sfchat.params"],
    ["sfchat.protocol"],
    ["sfchat.link"],
    ["sfchat.config", "sfchat.flags", "sfchat.history", "sfchat.console"],
    ["sfchat.model"],
    ["sfchat.engine"],
    ["sfchat.node"],
    ["sfchat.ui", "sfchat.serve", "sfchat.remote"],
    ["sfchat.cli", "sfchat.tui"],
]
# what never imports torch, directly or through the modules it imports
TORCH_FREE = ["sfchat.protocol", "sfchat.link", "sfchat.ui", "sfchat.remote", "sfchat.events", "sfchat.tally", "sfchat.plaintext",
              "sfchat.params", "sfchat.config", "sfchat.flags", "sfchat.history", "sfchat.console", "sfchat.engine.policy", "sfchat.engine.live",
              "sfchat.engine.frame", "relay"]


def modules() -> dict[str, Path]:
    out = {}
    for package in ("sfchat", "relay"):
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports (and ``torch`` if it does), lazily or not."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            if target.split(".")[0] == "torch":
                found.add("torch")
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def layer_of(name: str) -> int | None:
    best = None
    for i, layer in enumerate(LAYERS):
        for prefix in layer:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    return None if best is None else best[0]


MODULES = modules()
GRAPH = {name: imports(name, path, set(MODULES)) for name, path in MODULES.items()}


def test_every_module_has_a_layer():
    assert [m for m in MODULES if m.startswith("sfchat") and layer_of(m) is None] == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_point_down(name):
    if name.startswith("relay"):
        assert not {m for m in GRAPH[name] if m.startswith("sfchat")}, "the relay imports nothing of sfchat"
        return
    own = layer_of(name)
    upward = sorted(m for m in GRAPH[name] if m != "torch" and m.startswith("sfchat") and layer_of(m) > own)
    assert upward == [], f"{name} (layer {own}) imports from above: {upward}"


def test_no_import_circles():
    """Tarjan's strongly connected components over the project's imports: each must be one module."""
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH.get(v, ()):
            if w not in GRAPH:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert circles == []


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_torch_free_parts_never_reach_torch(prefix):
    start = [m for m in MODULES if m == prefix or m.startswith(prefix + ".")]
    assert start, prefix
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        assert "torch" not in GRAPH.get(m, ()), f"{m}, reached from {prefix}, imports torch"
        todo.extend(x for x in GRAPH.get(m, ()) if x in GRAPH)


def test_the_checker_sees_lazy_imports_and_circles(tmp_path):
    """The analysis itself: an import inside a function counts, and a two-module circle is found."""
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    assert imports("pkg.a", tmp_path / "a.py", {"pkg.a", "pkg.b"}) == {"pkg.b"}
    assert layer_of("sfchat.model.kv") == 4 and layer_of("sfchat.tally") == 0 and layer_of("sfchat.cli") == 8


def reached_from(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(x for x in GRAPH.get(m, ()) if x in GRAPH)
    return seen


def test_the_tail_process_never_reaches_the_heads_engine():
    """``sfchat --tail`` verifies; the head's driver, speculator, draft and loading are not its code."""
    reached = reached_from("sfchat.node.tail")
    assert "sfchat.engine.verifier" in reached and "sfchat.node.tail_loader" in reached
    assert reached.isdisjoint({"sfchat.node.driver", "sfchat.node.loading", "sfchat.engine.speculator",
                               "sfchat.engine.draft", "sfchat.engine.live"})
