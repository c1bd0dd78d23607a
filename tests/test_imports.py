"""The import graph of common/ has no circle and no import running up a layer: every module imports only
from its own layer or below, lazy imports inside functions included (a circle hidden in a function is still
a circle). The layers, bottom first: what everything reads (config, the registry, the results file), the
training run's pieces (process group, models, precision, data, checkpoints, the run's setup), the
instruments that measure it (common/measure/), the models that predict it (common/predict/), the loop
(train), the runner around every script, the report, and benchmark.py's subcommands (common/bench/)."""
import ast
import os

from helpers import ROOT

PACKAGE = os.path.join(ROOT, "common")


def module_name(path: str) -> str:
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def imports_of(path: str) -> set[str]:
    """common.* modules a file imports, resolved (from . import x, from ..y import z, import common.w)."""
    me = module_name(path)
    package = me if path.endswith("__init__.py") else me.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        else:
            continue
        out |= {c for c in candidates if c.startswith("common")}
    return out


def graph() -> dict[str, set[str]]:
    files = [os.path.join(d, f) for d, _, fs in os.walk(PACKAGE) for f in fs if f.endswith(".py")]
    modules = {module_name(f): f for f in files}
    return {m: {t for t in imports_of(f) if t in modules and t != m and t != "common"} for m, f in modules.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(m, path):
        state[m] = "open"
        for t in sorted(g[m]):
            if state.get(t) == "open":
                found.append(path[path.index(t):] + [t])
            elif t not in state:
                visit(t, path + [t])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def test_the_checker_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_common():
    assert cycles(graph()) == []


LAYERS = [
    {"common.fastexit", "common.names", "common.config", "common.launching", "common.registry", "common.results",
     "common.strategies"},
    {"common.distributed", "common.models", "common.precision", "common.data", "common.optim", "common.checkpoint",
     "common.pipeline", "common.tensor_parallel", "common.deepspeed_config", "common.accel", "common.runsetup"},
    {"common.measure"},
    {"common.predict"},
    {"common.train"},
    {"common.runner"},
    {"common.report"},
    {"common.bench"},
]


def layer(module: str) -> int:
    """The layer of a module: its own entry, else its package's (common.measure.comm: common.measure's)."""
    for i, members in enumerate(LAYERS):
        if module in members or any(module.startswith(m + ".") for m in members):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_imports.py LAYERS: give it one")


def upward(g: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})" for m, targets in g.items()
                  for t in targets if m != "common" and layer(t) > layer(m))


def test_the_checker_finds_an_import_running_up_a_layer():
    assert upward({"common.measure.comm": {"common.predict.memory"}, "common.predict.memory": set()}) == [
        "common.measure.comm (layer 2) imports common.predict.memory (layer 3)"]
    assert upward({"common.train": {"common.measure.comm"}, "common.measure.comm": set()}) == []


def test_no_import_runs_up_a_layer():
    """Printed with -s: each layer and its modules, the closing note's evidence."""
    g = {m: t for m, t in graph().items() if m != "common"}  # the package's names: the scripts' facade (PEP 562)
    for i in range(len(LAYERS)):
        print(f"layer {i}: " + ", ".join(sorted(m for m in g if layer(m) == i)))
    assert upward(g) == []


def test_a_process_that_imports_common_exits_without_the_last_gc_walk():
    """common/fastexit.py: the objects alive at exit are frozen once every atexit handler has run, so the
    interpreter's final collection skips torch's import-time objects (0.7-0.8 s of every launch's exit)."""
    import subprocess
    import sys

    code = "import common, atexit, gc; atexit._run_exitfuncs(); print(gc.get_freeze_count() > 0)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]


MAX_LINES = 60


def long_functions(root: str = PACKAGE) -> list[str]:
    """Every function (methods and nested ones too) of common/ longer than MAX_LINES lines, decorators left out."""
    found = []
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        lines = node.end_lineno - node.lineno + 1
                        if lines > MAX_LINES:
                            found.append(f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    return sorted(found)


def test_the_length_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n")
    assert long_functions(str(tmp_path)) == [f"{os.path.relpath(str(tmp_path / 'm.py'), ROOT)}:5 long (61 lines)"]


def test_every_function_in_common_fits_on_a_screen():
    assert long_functions() == []
