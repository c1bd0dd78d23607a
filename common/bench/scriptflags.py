"""The flags a top-level script takes, read from its source: a matrix's args are checked against them when
the file loads, so a typo is one line before any run instead of a failed row per run after each launch.

A script's flags are the fields of the config class its launch() names (`cfg_cls=`, else TrainConfig;
common/config.py build_parser makes one flag per field), less its OMIT. Its source is parsed, not imported:
importing it imports torch, and DeepSpeed for two of them (seconds each).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import os

from .. import config
from ..config import PROJECT_ROOT, UsageError


@functools.cache
def script_flags(script: str) -> frozenset[str]:
    """The field names (flag spellings with '_') script accepts."""
    with open(os.path.join(PROJECT_ROOT, script)) as fh:
        tree = ast.parse(fh.read(), script)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    name, own, omit = _cfg_cls(tree), set(), None
    while name in classes:  # the script's own classes, down to the one of common/config.py they extend
        node = classes[name]
        for item in node.body:
            target = item.target if isinstance(item, ast.AnnAssign) else (
                item.targets[0] if isinstance(item, ast.Assign) and len(item.targets) == 1 else None)
            if not isinstance(target, ast.Name):
                continue
            if target.id == "OMIT":  # OMIT = (...) or, as common/config.py spells it, OMIT: ClassVar[...] = (...)
                omit = _literal(script, item.value) if omit is None else omit  # the most derived class's
            elif isinstance(item, ast.AnnAssign) and "ClassVar" not in ast.unparse(item.annotation):
                own.add(target.id)
        name = node.bases[0].id if node.bases and isinstance(node.bases[0], ast.Name) else ""
    base = getattr(config, name, None)
    if not (isinstance(base, type) and dataclasses.is_dataclass(base)):
        raise UsageError(f"{script}: its config class does not extend one of common/config.py's")
    fields = own | {f.name for f in dataclasses.fields(base)}
    return frozenset(fields - (set(base.OMIT) if omit is None else omit))


def _literal(script: str, value) -> set[str]:
    try:
        return set(ast.literal_eval(value))
    except (ValueError, TypeError, SyntaxError):
        raise UsageError(f"{script}: its OMIT is not a literal tuple of field names, which the matrix check reads"
                         ) from None


def _cfg_cls(tree: ast.Module) -> str:
    """The class its launch(main, __file__, cfg_cls) names (common/runner.py launch, launch_tool), else
    TrainConfig, launch's default."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("launch", "launch_tool"):
            named = [kw.value for kw in node.keywords if kw.arg == "cfg_cls"] + node.args[2:3]
            return named[0].id if named and isinstance(named[0], ast.Name) else "TrainConfig"
    raise UsageError("no launch(...) call, which names the config class the matrix check reads")


def unknown_args(script: str, args: dict) -> list[str]:
    """The keys of args that script has no flag for, as flags (--name-with-dashes)."""
    flags = script_flags(script)
    return ["--" + str(k).replace("_", "-") for k in args if str(k).replace("-", "_") not in flags]
