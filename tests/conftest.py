"""pytest set-up: the project root on sys.path, and the suite's promise to leave the checkout as it found
it. Helpers live in tests/helpers.py, the shared launches in tests/launches.py."""
import os
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
sys.path.insert(0, ROOT)

from launches import launched  # noqa: E402,F401  the session's shared end-to-end runs (tests/launches.py)

# Every test runs on this one host, the Slurm "nodes" included: gloo talks over loopback, whatever the
# hostname resolves to (common/distributed.py, gloo_on_loopback_when_one_node, says why it matters).
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

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
def shared_memory_released():
    """Runs this session killed (kill-and-resume, restarts, timeouts) never reached their cleanup: their
    DeepSpeed buffers in /dev/shm (66 MB each, memory; common/distributed.py release_deepspeed_shm)
    go when the session ends."""
    import glob

    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*"
    before = set(glob.glob(pattern))
    yield
    for path in set(glob.glob(pattern)) - before:
        try:
            os.remove(path)
        except OSError:
            pass


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


# CI stops at 90 minutes with only the tail of the output kept: a suite that has not ended by 70 (its
# budget is 20) stops itself, so the failures so far and the slowest tests still get printed
DEADLINE_S = 60 * float(os.environ.get("SUITE_DEADLINE_MIN", "70"))
STARTED = time.time()


def pytest_runtest_setup(item):
    if time.time() - STARTED > DEADLINE_S:
        pytest.exit(f"the suite ran past {DEADLINE_S / 60:.0f} minutes (its budget is 20); stopped before "
                    f"{item.nodeid}", returncode=3)


def pytest_collection_finish(session):
    """Before any end-to-end test: two processes must form a gloo group here, or the suite stops at once
    with why (each launch would otherwise wait out its own timeout: a CI run of 90 minutes, all red)."""
    if any(item.get_closest_marker("slow") for item in session.items):
        from helpers import gloo_pair_problem

        problem = gloo_pair_problem()
        if problem:
            pytest.exit(problem, returncode=3)
        # the first DeepSpeed process of an environment compiles an op (common/bench/doctor.py says which):
        # minutes that would otherwise fall inside whichever launch comes first, and its timeout
        import subprocess

        proc = subprocess.run([sys.executable, "-c", "from common.bench.doctor import build_deepspeed_cpu_ops as b; "
                               "print(b())"], cwd=ROOT, capture_output=True, text=True, timeout=1500)
        if proc.returncode:
            pytest.exit(f"DeepSpeed's CPU op did not build: {(proc.stderr.strip().splitlines() or ['?'])[-1]}",
                        returncode=3)
        sys.stderr.write(f"\nDeepSpeed's CPU op: {proc.stdout.strip().splitlines()[-1]}\n")


# A launch that overruns its timeout is killed (subprocess.run kills the launcher), and its workers
# (torchrun's, DeepSpeed's, benchmark.py's own sessions) lived on: on a 2-core machine they starved
# every later test into its own timeout, one failure became the whole suite's. As the processes'
# subreaper, pytest inherits every orphan; after a test that failed, those that appeared during it die.
PR_SET_CHILD_SUBREAPER = 36
DAEMONS = {"slurmctld", "slurmd", "slurmstepd", "munged"}  # the test cluster's, shared by the module


def _subreaper() -> bool:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


SUBREAPER = sys.platform == "linux" and _subreaper()


def descendants(root: int) -> dict[int, str]:
    """{pid: command name} of every live process under root, read from /proc; reaps root's dead children
    that nobody waits for (orphans the subreaper inherited and that ended)."""
    parent, name = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        comm_end = stat.rindex(")")
        fields = stat[comm_end + 2:].split()
        if fields[0] != "Z":
            parent[int(entry)], name[int(entry)] = int(fields[1]), stat[stat.index("(") + 1:comm_end]
        elif int(fields[1]) == root == os.getpid():
            try:
                os.waitpid(int(entry), os.WNOHANG)
            except ChildProcessError:  # a child a Popen of the test's own still holds
                pass
    found, frontier = {}, [root]
    while frontier:
        here = frontier.pop()
        for pid, ppid in parent.items():
            if ppid == here and pid not in found:
                found[pid] = name[pid]
                frontier.append(pid)
    return found


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = set(descendants(os.getpid())) if SUBREAPER else set()
    yield
    failed = any(r.failed for r in getattr(item, "_reports", []))
    if SUBREAPER and not failed:
        descendants(os.getpid())  # reaps
    if SUBREAPER and failed:
        import signal

        left = {p: n for p, n in descendants(os.getpid()).items() if p not in before and n not in DAEMONS}
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)
        descendants(os.getpid())  # reaps those that were its children
        if left:
            sys.stderr.write(f"\n{item.nodeid} failed and left {len(left)} process(es); killed: "
                             f"{', '.join(sorted(set(left.values())))}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    item._reports = [*getattr(item, "_reports", []), outcome.get_result()]
