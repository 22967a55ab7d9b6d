"""The package's shape, read from its source with ast: no import cycles (module-level, inside
functions, or through importlib.import_module), dependencies pointing one way, the environment read
in one module, and no module past 450 lines outside the kernels."""
from __future__ import annotations

import ast
import re
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "asyncllm"
MAX_LINES = 450

# Every module's layer, top first (docs/ARCHITECTURE.md). A module imports modules of its own layer or
# of lower ones; a new module must be placed here. structured/'s spec sits with sampling_params at the
# bottom; its grammar and step masks sit under the engine, which drives them, beside the runner.
LAYERS = (
    ("api", ("asyncllm", "asyncllm.llm", "asyncllm.async_engine", "asyncllm.engine_thread", "asyncllm.streams",
             "asyncllm.detokenizer", "asyncllm.reasoning", "asyncllm.server", "asyncllm.cli", "asyncllm.vllm",
             "asyncllm.arguments", "asyncllm.chat_template")),
    ("engine", ("asyncllm.engine", "asyncllm.speculative")),
    ("runner", ("asyncllm.runner", "asyncllm.structured.grammar", "asyncllm.structured.step_masks")),
    ("models", ("asyncllm.models",)),
    ("layers", ("asyncllm.layers", "asyncllm.attention")),
    ("kernels", ("asyncllm.kernels",)),
    ("base", ("asyncllm.config", "asyncllm.settings", "asyncllm.sampling_params", "asyncllm.pooling_params",
              "asyncllm.structured", "asyncllm.structured.spec", "asyncllm.errors", "asyncllm.validation",
              "asyncllm.outputs", "asyncllm.distributed", "asyncllm.startup", "asyncllm.startup_cache",
              "asyncllm.step_plan", "asyncllm.testing")),
)

# The upward imports there are today, each an exact (importer, imported) pair; none since the step
# contract (asyncllm/step_plan.py: StepPlan / StepResult): the runner and structured/ read the engine's
# step through it. No upward edge may appear, and a pair that is gone must leave this list.
ALLOWED_UPWARD: set[tuple[str, str]] = set()

SETTINGS_MODULE = "asyncllm.settings"  # the one module that reads the environment
ENVIRONMENT_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, pathlib.Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def lazy_exports() -> dict[str, str]:
    """asyncllm/__init__.py's _EXPORTS (public name -> the module it is imported from on first use)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("asyncllm/__init__.py: no _EXPORTS")


def dynamic_import_targets(name: str, node: ast.Call, known: set[str]) -> list[str] | None:
    """The modules an importlib.import_module(...) or __import__(...) call may import, or None where
    node is no such call. A constant name is that module; an f-string counts as every module its
    constant start names the start of (f"asyncllm.kernels.{name}": all of kernels/'s modules)."""
    func = node.func
    if not ((isinstance(func, ast.Attribute) and func.attr == "import_module")
            or (isinstance(func, ast.Name) and func.id in ("import_module", "__import__"))):
        return None
    arg = node.args[0] if node.args else None
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if name == "asyncllm" and isinstance(arg, ast.Name):  # the package's lazy exports: its _EXPORTS' modules
        return sorted(set(lazy_exports().values()))
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        prefix = arg.values[0].value
        return [module for module in known if module.startswith(prefix)]
    raise AssertionError(f"{name}:{node.lineno}: a dynamic import whose module this check cannot read; "
                         "name the module, or an f-string starting with its package")


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The package's modules that this one imports, anywhere in it (functions too, and importlib's)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: a relative import (the package imports by absolute names)"
            base = node.module
            # `from pkg import sub` imports the submodule; `from mod import name` the module
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        elif isinstance(node, ast.Call) and (dynamic := dynamic_import_targets(name, node, known)) is not None:
            targets = dynamic
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


def layer_of(name: str) -> int:
    """The index in LAYERS of the layer whose longest prefix names this module."""
    matches = [(len(prefix), index) for index, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
               if name == prefix or (prefix != "asyncllm" and name.startswith(prefix + "."))]
    assert matches, f"{name} is in no layer: place it in tests/test_layout.py's LAYERS"
    return max(matches)[1]


def upward_edges(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(name, target) for name, targets in graph.items() for target in targets
            if layer_of(target) < layer_of(name)}


def environment_reads(path: pathlib.Path) -> list[int]:
    """Lines where the module touches the process environment through os (os.environ, os.getenv, ...)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr in ENVIRONMENT_NAMES \
                and isinstance(node.value, ast.Name) and node.value.id == "os":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(alias.name in ENVIRONMENT_NAMES for alias in node.names):
            lines.append(node.lineno)
    return lines


def test_the_graph_is_read():
    graph = import_graph()
    assert "asyncllm.runner.model_runner" in graph["asyncllm.engine.core"]
    assert "asyncllm.attention.triton_backend" in graph["asyncllm.attention"]  # a function-level import
    assert "asyncllm.kernels.skinny_gemm" in graph["asyncllm.layers.fused"]  # importlib, an f-string
    assert "asyncllm.structured.compile_jobs" in graph["asyncllm.structured.grammar"]  # structured/ is read
    assert "asyncllm.step_plan" in graph["asyncllm.runner.request_table"]
    # the check sees an upward edge (the runner and structured/ reading engine/ through it, as before
    # the step contract) and not a downward one
    assert upward_edges({"asyncllm.runner.model_runner": {"asyncllm.engine.scheduler", "asyncllm.step_plan"},
                         "asyncllm.structured.step_masks": {"asyncllm.engine.sequence"}}) == {
        ("asyncllm.runner.model_runner", "asyncllm.engine.scheduler"),
        ("asyncllm.structured.step_masks", "asyncllm.engine.sequence")}
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_dynamic_imports_are_read_or_refused():
    known = {"asyncllm.kernels", "asyncllm.kernels.pdl", "asyncllm.kernels.host", "asyncllm.engine.core"}

    def targets(source: str):
        return dynamic_import_targets("m", ast.parse(source).body[0].value, known)

    assert targets("importlib.import_module('asyncllm.engine.core')") == ["asyncllm.engine.core"]
    assert sorted(targets("importlib.import_module(f'asyncllm.kernels.{name}')")) == ["asyncllm.kernels.host",
                                                                                     "asyncllm.kernels.pdl"]
    assert targets("__import__('asyncllm.engine.core')") == ["asyncllm.engine.core"]
    assert targets("print('asyncllm.engine.core')") is None
    try:
        targets("importlib.import_module(name)")
    except AssertionError as e:
        assert "cannot read" in str(e)
    else:
        raise AssertionError("an unreadable dynamic import was not refused")


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_has_a_layer():
    for name in modules():
        layer_of(name)


def test_imports_point_down_the_layers():
    graph = import_graph()
    new = sorted(upward_edges(graph) - ALLOWED_UPWARD)
    assert not new, [f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})" for a, b in new]


def test_the_allowed_upward_imports_still_exist():
    gone = sorted(ALLOWED_UPWARD - upward_edges(import_graph()))
    assert not gone, f"no longer imported: take these out of ALLOWED_UPWARD: {gone}"


def test_config_imports_only_the_shared_refusals_and_settings_nothing():
    graph = import_graph()
    # but the refusals every validator shares, which import nothing else
    assert graph["asyncllm.config"] == {"asyncllm.errors", "asyncllm.validation"}
    assert graph["asyncllm.validation"] == {"asyncllm.errors"} and graph["asyncllm.errors"] == set()
    assert graph[SETTINGS_MODULE] == set()


def test_only_the_settings_module_reads_the_environment():
    reads = {name: lines for name, path in modules().items() if name != SETTINGS_MODULE
             and (lines := environment_reads(path))}
    assert not reads, f"read environment variables through asyncllm/settings.py, not os.environ: {reads}"
    assert environment_reads(modules()[SETTINGS_MODULE])  # the check sees the one that does


DEVICE_WIDE_MODULE = "asyncllm.layers.device_wide"


def device_wide_calls(path: pathlib.Path) -> list[int]:
    """Lines calling torch.cuda.synchronize or torch.cuda.empty_cache (an attribute chain ending so)."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("synchronize", "empty_cache") and ast.unparse(node.func.value) == "torch.cuda"]


def test_device_wide_waits_go_through_the_lock():
    """A device-wide synchronize or empty_cache from one engine's thread breaks another engine's CUDA-graph
    capture: every one goes through layers/device_wide.py, which holds DEVICE_WIDE around it."""
    calls = {name: lines for name, path in modules().items() if name != DEVICE_WIDE_MODULE
             and (lines := device_wide_calls(path))}
    assert not calls, f"call device_wide.synchronize / empty_cache instead: {calls}"
    assert device_wide_calls(modules()[DEVICE_WIDE_MODULE])  # the check sees the ones that do


def test_no_module_is_too_long():
    long = {name: n for name, path in modules().items() if not within(name, ("asyncllm.kernels",))
            and (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these (more than {MAX_LINES} lines): {long}"


# a benchmark run's name ("run AE", "runs AG and AH", "run X3") or a date: when something was seen, which
# belongs in docs/BENCHMARKS_ARCHIVE.md; the code's comments say why (issue 49)
RUN_CITATION = re.compile(r"\bruns? (?:[A-Z]{2}|[A-Z]\d)\b|\b20\d\d-\d\d-\d\d\b")


def test_comments_cite_no_benchmark_runs_or_dates():
    cited = {name: [i for i, line in enumerate(path.read_text().splitlines(), 1) if RUN_CITATION.search(line)]
             for name, path in modules().items()}
    cited = {name: lines for name, lines in cited.items() if lines}
    assert not cited, f"say why, not when (the run's figures go to docs/BENCHMARKS_ARCHIVE.md): {cited}"
    assert RUN_CITATION.search("(runs AG and AH: one output") and RUN_CITATION.search("run X3, 2026-12-04")
    assert not RUN_CITATION.search("runs N processes that share the port")
