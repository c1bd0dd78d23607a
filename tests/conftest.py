"""pytest set-up: the project root on sys.path, and the suite's promise to leave the checkout as it found
it. Helpers live in tests/helpers.py, the shared launches in tests/launches.py."""
import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
sys.path.insert(0, ROOT)

from launches import launched  # noqa: E402,F401  the session's shared end-to-end runs (tests/launches.py)

# caches and environments, not the project's files
SKIP_DIRS = {".git", ".venv", "venv", "__pycache__", ".ruff_cache", ".pytest_cache", ".mypy_cache"}


def tree(root: str) -> dict[str, tuple[int, int]]:
    """(size, mtime) of every file under root outside SKIP_DIRS."""
    found = {}
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            path = os.path.join(here, name)
            try:
                st = os.stat(path)
            except OSError:  # removed while walking
                continue
            found[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns)
    return found


def changes(before: dict, after: dict) -> list[str]:
    return sorted([f"new {p}" for p in after.keys() - before.keys()] +
                  [f"removed {p}" for p in before.keys() - after.keys()] +
                  [f"changed {p}" for p in before.keys() & after.keys() if before[p] != after[p]])


@pytest.fixture(scope="session", autouse=True)
def checkout_left_as_found():
    """A test that writes into the checkout (a benchmark.py run without --results/--report/--save-dir, say)
    overwrites the user's results/REPORT.md and fills checkpoints/ with hundreds of MB; every output belongs
    under tmp_path. Fails the session, naming the files, when the project tree changed."""
    before = tree(ROOT)
    yield
    touched = changes(before, tree(ROOT))
    if touched:
        pytest.fail(f"the tests wrote into the checkout {ROOT} (send outputs to tmp_path): "
                    + ", ".join(touched[:20]) + (f" and {len(touched) - 20} more" if len(touched) > 20 else ""),
                    pytrace=False)
