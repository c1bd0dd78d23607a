"""pytest set-up: the project root on sys.path, and the suite's promise to leave the checkout as it found
it. Helpers live in tests/helpers.py, the shared launches in tests/launches.py."""
import contextlib
import os
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
sys.path.insert(0, ROOT)

import launches  # noqa: E402
from helpers import descendants  # noqa: E402
from launches import launched, runs  # noqa: E402,F401  the session's shared end-to-end runs (tests/launches.py)

# Every test runs on this one host, the Slurm "nodes" included: gloo talks over loopback, whatever the
# hostname resolves to (common/distributed.py, gloo_on_loopback_when_one_node, says why it matters).
if "GLOO_SOCKET_IFNAME" not in os.environ:
    import socket

    _loopback = [n for _, n in socket.if_nameindex() if n in ("lo", "lo0")]  # lo0: macOS
    if _loopback:
        os.environ["GLOO_SOCKET_IFNAME"] = _loopback[0]

# The interpreter's own bin first on PATH, as `.ci/run`'s activated venv has it, also where pytest was started as
# `.venv/bin/python -m pytest`: the tools the runs find there are then the venv's. The one that matters is ninja:
# the venv ships pip's, and a system ninja hashes the same build command differently, so DeepSpeed's CPU op (the
# set-up below) was compiled again each time a process with the other ninja loaded it (a Slurm
# job's PATH puts the venv first: tests/test_slurm.py slurm_env).
_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _BIN:
    os.environ["PATH"] = _BIN + os.pathsep + os.environ.get("PATH", "")

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
    launches.RUNNING = item.nodeid
    if launches.ACTIVE is not None:  # how many shared launches may run beside this test (tests/launches.py)
        launches.ACTIVE.allow(launches.limit_for(item))


# The tests whose own processes leave a core idle for long (a cold torch.compile, Slurm jobs one after the other,
# a calibration that times one process at a time, repeats): they run first, while every shared launch of the
# session is still ahead of them to fill that core (tests/launches.py `beside`). At the end of the session, where
# their modules fall alphabetically, few are, and half of the suite's idle core-seconds were in these tests
# (the suite campaigns of docs/measured.md). A module with a fixture these tests share moves whole (the Slurm cluster).
FIRST = ("tests/test_slurm.py::", "tests/test_scripts.py::test_training_learns_on_synthetic_data",
         "tests/test_scripts.py::test_compile_time_kept_apart_and_same_training",
         "tests/test_time.py::test_calibrate_then_a_run_predicts_itself",
         "tests/test_stats.py::test_repeats_end_to_end_and_resume")


def pytest_collection_modifyitems(config, items):
    """A launches marker names launches of CASES: a typo found when collected, not as a KeyError in whichever
    test's setup happens to start the look-ahead (tests/launches.py). Then FIRST's tests to the front, each
    group in its collected order."""
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: the rest keep theirs
    for item in items:
        try:
            unknown = [n for n in launches.marked_needs(item) if n not in launches.CASES]
        except (KeyError, IndexError, AttributeError) as exc:  # a template field the test has no parameter for
            raise pytest.UsageError(f"{item.nodeid}: its launches marker has a template it cannot fill: "
                                    f"{exc!r}") from None
        if unknown:
            raise pytest.UsageError(f"{item.nodeid}: its launches marker names {', '.join(unknown)}, "
                                    "not a launch of tests/launches.py CASES")


def pytest_configure(config):
    """pytest's temporary files in memory where helpers.ram_temproot finds the room (it says why), before
    the first test asks for its tmp_path (pytest reads PYTEST_DEBUG_TEMPROOT then: _pytest/tmpdir.py
    getbasetemp)."""
    from helpers import ram_temproot

    root = ram_temproot(config.option.basetemp)
    if root:
        os.environ["PYTEST_DEBUG_TEMPROOT"] = root


def pytest_collection_finish(session):
    """Before any end-to-end test: the disk must hold what the suite writes, and two processes must form a gloo
    group here, or the suite stops at once with why (each launch would otherwise wait out its own timeout: a CI
    run of 90 minutes, all red)."""
    if session.config.option.collectonly:
        return
    if any(item.get_closest_marker("slow") for item in session.items):
        import tempfile

        from helpers import disk_problem, gloo_pair_problem

        basetemp = session.config.option.basetemp
        temproot = os.environ.get("PYTEST_DEBUG_TEMPROOT") or tempfile.gettempdir()
        problem = disk_problem(os.path.dirname(os.path.abspath(basetemp)) if basetemp else temproot)
        if problem:
            pytest.exit(problem, returncode=3)
        problem = gloo_pair_problem()
        if problem:
            pytest.exit(problem, returncode=3)
        # the first DeepSpeed process of an environment compiles an op (common/bench/doctor.py says which):
        # minutes that would otherwise fall inside whichever launch comes first, and its timeout
        import signal
        import subprocess

        proc = subprocess.Popen([sys.executable, "-c", "from common.bench.doctor import build_deepspeed_cpu_ops as b; "
                                 "print(b())"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=1500)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the compilers with it
            pytest.exit("DeepSpeed's CPU op did not build within 1500 s", returncode=3)
        if proc.returncode:
            pytest.exit(f"DeepSpeed's CPU op did not build: {(err.strip().splitlines() or ['?'])[-1]}", returncode=3)
        sys.stderr.write(f"\nDeepSpeed's CPU op: {(out.strip().splitlines() or ['?'])[-1]}\n"
                         f"pytest's temporary files: under {basetemp or temproot}\n")


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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    # after set-up: what module and session fixtures started belongs to them, not to the test
    item._procs_before = set(descendants(os.getpid())) if SUBREAPER else set()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = set(descendants(os.getpid())) if SUBREAPER else set()
    yield
    failed = any(r.failed for r in getattr(item, "_reports", []))
    if SUBREAPER and failed:
        import signal

        before = getattr(item, "_procs_before", before)
        # the shared launches the next tests read are spared: the launches' lock held to the kills, so that none
        # starts unseen (tests/launches.py _launch), and their processes walked after ours, so that a worker a
        # launcher forks meanwhile is in both walks
        with launches.ACTIVE.lock if launches.ACTIVE else contextlib.nullcontext():
            shared = launches.ACTIVE.running_pids() if launches.ACTIVE else []
            ours = descendants(os.getpid())
            before |= {p for pid in shared for p in (pid, *descendants(pid))}
            left = {p: n for p, n in ours.items() if p not in before and n not in DAEMONS}
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        time.sleep(0.5)
        for pid in left:  # those the subreaper inherited are its children now: no zombies of ours left
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass
        if left:
            sys.stderr.write(f"\n{item.nodeid} failed and left {len(left)} process(es); killed: "
                             f"{', '.join(sorted(set(left.values())))}\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    item._reports = [*getattr(item, "_reports", []), outcome.get_result()]


@pytest.fixture(autouse=True)
def no_collection_before_the_window(monkeypatch):
    """The loop collects the garbage the set-up left before its loader probe and timed window
    (common/train.py): in pytest's process that is a full pass over about a million objects, 0.33 s a
    call, 7 s of the fast tier's 68. The tests that check those calls set their own; the training runs the
    suite launches collect as users' runs do."""
    from types import SimpleNamespace

    for module in ("common.train", "common.measure.loader"):  # their own name only: gc itself stays
        monkeypatch.setattr(f"{module}.gc", SimpleNamespace(collect=lambda *a: 0))
    # a runner.launch() in pytest's process would freeze every earlier test's garbage for the session
    # (common/fastexit.py); test_guards checks when a run freezes
    monkeypatch.setattr("common.runner.freeze_imports", lambda: None)
