"""The package's shape, read from its source with ast: no import cycles (module-level or inside
functions), dependencies pointing one way, and no module past 450 lines outside the kernels."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncllm"
MAX_LINES = 450

# the lower layers never reach up into what drives them
LOWER = ("asyncllm.layers", "asyncllm.models", "asyncllm.kernels", "asyncllm.attention")
UPPER = ("asyncllm.engine", "asyncllm.runner", "asyncllm.async_engine", "asyncllm.streams", "asyncllm.llm",
         "asyncllm.arguments", "asyncllm.chat_template", "asyncllm.server", "asyncllm.cli")


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that this one imports, anywhere in it (functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: a relative import (the package imports by absolute names)"
            base = node.module
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # `import asyncllm.x.y` of a non-module: its module
                target = target.rpartition(".")[0]
            if target.startswith("asyncllm") and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_graph_is_read():
    graph = import_graph()
    assert "asyncllm.runner.model_runner" in graph["asyncllm.engine.core"]
    assert "asyncllm.attention.triton_backend" in graph["asyncllm.attention"]  # a function-level import
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_lower_layers_do_not_import_upper_ones():
    bad = [f"{name} imports {target}" for name, targets in import_graph().items() if within(name, LOWER)
           for target in targets if within(target, UPPER)]
    assert not bad, bad


def test_runner_does_not_import_the_engine_or_the_apis():
    upper = tuple(p for p in UPPER if p != "asyncllm.runner")
    bad = [f"{name} imports {target}" for name, targets in import_graph().items() if within(name, ("asyncllm.runner",))
           for target in targets if within(target, upper) and target not in ("asyncllm.engine.scheduler",
                                                                             "asyncllm.engine.sequence")]
    assert not bad, bad


def test_config_imports_nothing_of_the_package():
    assert import_graph()["asyncllm.config"] == set()


def test_no_module_is_too_long():
    long = {name: n for name, path in modules().items() if not within(name, ("asyncllm.kernels",))
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these (more than {MAX_LINES} lines): {long}"
