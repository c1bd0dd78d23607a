"""The import graph of common/ has no circle: every module imports only from below itself, lazy
imports inside functions included (a circle hidden in a function is still a circle)."""
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


def test_a_process_that_imports_common_exits_without_the_last_gc_walk():
    """common/fastexit.py: the objects alive at exit are frozen once every atexit handler has run, so the
    interpreter's final collection skips torch's import-time objects (0.7-0.8 s of every launch's exit)."""
    import subprocess
    import sys

    code = "import common, atexit, gc; atexit._run_exitfuncs(); print(gc.get_freeze_count() > 0)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
