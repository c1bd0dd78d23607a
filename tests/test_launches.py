"""The look-ahead of the shared launches (tests/launches.py): how many run beside which test, and what a
test's monkeypatching can no longer reach. The launches themselves are replaced by gates the test opens.
And the disk they write to: a full suite that would not fit stops before its first test, and its files go to
memory where there is room."""
import os
import sys
import threading
import time
from types import SimpleNamespace

import helpers
import launches
import pytest
from helpers import release_port


def wait_for(cond, what: str) -> None:
    deadline = time.time() + 30
    while not cond():
        assert time.time() < deadline, what
        time.sleep(0.01)


def test_the_look_ahead_fills_what_the_running_test_leaves_and_no_more(tmp_path, monkeypatch):
    a, b, c = "pytorch_SingleGPU-fp32", "pytorch_DDP-fp32", "pytorch_FSDP-fp32"
    shared = launches.SharedLaunches(tmp_path)
    python = sys.executable
    gates, started = {n: threading.Event() for n in (a, b, c)}, []

    def gated(name, case, folder, cmd, port):
        started.append(name)
        gates[name].wait(30)
        release_port(port)
        return cmd

    shared._launch = gated
    # t0 fast, t1 reads a, t2 slow (say, a kill and a resume), t3 reads b and c, t4 slow
    shared.needs = [[], [a], [], [b, c], []]
    shared.index = {f"t{i}": i for i in range(5)}
    # what a fast test may patch while a launch is planned: neither reaches the launch
    monkeypatch.setattr(sys, "executable", "/nowhere/python")
    monkeypatch.setenv("PATCHED_BY_A_TEST", "1")
    try:
        monkeypatch.setattr(launches, "RUNNING", "t0")  # a fast test: one launch beside it, found past it
        shared.allow(1)
        wait_for(lambda: started == [a], f"one launch beside a fast test: {started}")
        time.sleep(0.2)
        assert started == [a]
        gates[a].set()  # the next one starts when it ends, looking past t2 (it waits for b when it starts)
        wait_for(lambda: started == [a, b], f"the next launch when one ends: {started}")
        monkeypatch.setattr(launches, "RUNNING", "t1")  # reads shared launches: two at once
        shared.allow(launches.IN_FLIGHT)
        wait_for(lambda: started == [a, b, c], f"two beside a test that reads launches: {started}")
        assert shared.futures[a].result()[0] == python  # built from the session's launchers, not the patched
        assert "PATCHED_BY_A_TEST" not in shared.env
        monkeypatch.setattr(launches, "RUNNING", "t4")  # any other test: waits for those in flight
        threading.Timer(0.3, lambda: [g.set() for g in gates.values()]).start()
        shared.allow(0)
        assert all(f.done() for f in shared.futures.values())
    finally:
        for g in gates.values():
            g.set()
        shared.close()
    assert started == [a, b, c] and not os.path.exists(tmp_path)


def test_a_test_marked_beside_allows_one_launch_even_when_it_reads_shared_ones():
    """The calibration reads a shared launch, then runs its own two processes: one launch beside them, not two."""
    from types import SimpleNamespace

    def item(*marks):
        return SimpleNamespace(get_closest_marker=lambda name: name if name in marks else None)

    assert launches.limit_for(item()) == 1  # the fast tier
    assert launches.limit_for(item("slow", "beside", "launches")) == 1
    assert launches.limit_for(item("slow", "launches")) == launches.IN_FLIGHT > 1
    assert launches.limit_for(item("slow")) == 0


def test_a_full_suite_the_disk_cannot_hold_stops_before_its_first_test(tmp_path, monkeypatch, pytestconfig):
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")  # not tests/gpu's
    conftest = next(m for m in pytestconfig.pluginmanager.get_plugins() if getattr(m, "__file__", None) == here)
    slow = SimpleNamespace(get_closest_marker=lambda name: name == "slow" or None)
    session = SimpleNamespace(items=[slow], config=SimpleNamespace(
        option=SimpleNamespace(collectonly=False, basetemp=str(tmp_path / "base"))))
    monkeypatch.setattr(helpers, "gloo_pair_problem", lambda: "reached the gloo check")
    monkeypatch.setattr(helpers, "SUITE_DISK_GIB", 2.0**40)  # a TiB more than any disk here holds
    with pytest.raises(pytest.exit.Exception, match=rf"GiB free under {tmp_path}, and the full suite writes"):
        conftest.pytest_collection_finish(session)
    monkeypatch.setattr(helpers, "SUITE_DISK_GIB", 0)
    with pytest.raises(pytest.exit.Exception, match="reached the gloo check"):
        conftest.pytest_collection_finish(session)


def test_the_suites_files_go_to_memory_only_where_there_is_room_for_them(tmp_path, monkeypatch, pytestconfig):
    """helpers.ram_temproot takes a tmpfs with room, and conftest.py points pytest's temporary files there;
    not where the user chose a place, the folder is on a disk, it has too little free, or the memory left
    would not hold the suite's files and its launches."""
    folder, mounts, meminfo = tmp_path / "shm", tmp_path / "mounts", tmp_path / "meminfo"
    folder.mkdir()
    monkeypatch.setattr(helpers, "SUITE_DISK_GIB", 0)
    need = helpers.LAUNCH_MEMORY_GIB

    def pick(kind="tmpfs", available_gib=need, basetemp=None, environ=None):
        mounts.write_text(f"/dev/vda / ext4 rw 0 0\nnone {folder} {kind} rw,size=4g 0 0\n")
        meminfo.write_text(f"MemTotal: {64 * 2**20} kB\nMemAvailable: {int(available_gib * 2**20)} kB\n")
        return helpers.ram_temproot(basetemp, environ or {}, str(folder), str(mounts), str(meminfo))

    assert pick() == str(folder)
    assert pick(kind="ext4") is None
    assert pick(available_gib=need - 0.01) is None
    assert pick(basetemp=str(tmp_path / "base")) is None
    assert pick(environ={"TMPDIR": "/var/tmp"}) is None and pick(environ={"PYTEST_DEBUG_TEMPROOT": "/x"}) is None
    monkeypatch.setattr(helpers, "SUITE_DISK_GIB", 2.0**40)  # a TiB more than the folder has free
    assert pick(available_gib=2.0**41) is None

    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conftest.py")
    conftest = next(m for m in pytestconfig.pluginmanager.get_plugins() if getattr(m, "__file__", None) == here)
    monkeypatch.delenv("PYTEST_DEBUG_TEMPROOT", raising=False)
    monkeypatch.setattr(helpers, "ram_temproot", lambda basetemp: None if basetemp else str(folder))
    conftest.pytest_configure(SimpleNamespace(option=SimpleNamespace(basetemp="/given")))
    assert "PYTEST_DEBUG_TEMPROOT" not in os.environ
    conftest.pytest_configure(SimpleNamespace(option=SimpleNamespace(basetemp=None)))
    assert os.environ["PYTEST_DEBUG_TEMPROOT"] == str(folder)


def test_a_failed_tests_clean_up_spares_a_worker_a_shared_launcher_forks_meanwhile(monkeypatch, pytestconfig):
    """After a failed test conftest.py kills what the test left, sparing the shared launches the next tests read.
    A worker their launcher forks after the launcher's processes were walked, but before ours, was taken for
    the test's leftover: its launch died with -9 and every test reading it failed."""
    here = os.path.join(os.path.dirname(__file__), "conftest.py")  # not tests/gpu's, also named conftest
    (conftest,) = [p for p in pytestconfig.pluginmanager.get_plugins() if getattr(p, "__file__", None) == here]

    launcher, worker, stray = 10**7 + 1, 10**7 + 2, 10**7 + 3
    walks = []  # ours: before the test, then the clean-up's; the worker exists from the clean-up's walk on

    def descendants(pid):
        if pid == os.getpid():
            walks.append(pid)
            return {launcher: "torchrun", stray: "python"} | ({worker: "python"} if len(walks) > 1 else {})
        return {worker: "python"} if len(walks) > 1 and pid == launcher else {}

    killed = []
    monkeypatch.setattr(conftest, "descendants", descendants)
    monkeypatch.setattr(conftest, "SUBREAPER", True)
    monkeypatch.setattr(conftest.time, "sleep", lambda s: None)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append(pid))
    monkeypatch.setattr(os, "waitpid", lambda pid, flags: (0, 0))
    monkeypatch.setattr(launches, "ACTIVE", SimpleNamespace(lock=threading.RLock(), running_pids=lambda: [launcher]))
    item = SimpleNamespace(_reports=[SimpleNamespace(failed=True)], _procs_before=set(), nodeid="t")
    gen = conftest.pytest_runtest_protocol(item, None)
    next(gen)
    with pytest.raises(StopIteration):
        next(gen)
    assert killed == [stray]


def test_the_tests_moved_first_are_slow_tests_that_leave_room_beside_them():
    """conftest.FIRST moves tests to the front of the session by their node ids: a renamed test would silently
    stay where it was. Each entry names a test function that exists, marked slow and beside (a test that leaves
    a core to a launch), or a whole module with such a test in it."""
    import ast

    # read from the file: `import conftest` may find tests/gpu/conftest.py, which pytest registered under that name
    source = ast.parse(open(os.path.join(helpers.ROOT, "tests", "conftest.py")).read())
    (first,) = [ast.literal_eval(n.value) for n in source.body if isinstance(n, ast.Assign)
                and [ast.unparse(t) for t in n.targets] == ["FIRST"]]
    for entry in first:
        path, _, name = entry.partition("::")
        tree = ast.parse(open(os.path.join(helpers.ROOT, path)).read())
        module_slow = any(isinstance(n, ast.Assign) and ast.unparse(n) == "pytestmark = pytest.mark.slow"
                          for n in tree.body)
        tests = {f.name: {ast.unparse(d) for d in f.decorator_list} | ({"pytest.mark.slow"} if module_slow else set())
                 for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")}
        if name:
            assert name in tests, f"{entry}: no such test"
        moved = [tests[name]] if name else list(tests.values())
        assert any({"pytest.mark.slow", "pytest.mark.beside"} <= marks for marks in moved), \
            f"{entry}: not a slow test marked beside"
