"""The host's share of the timed window (common/measure/host.py): /proc read from a fake tree (the CPUs of
the affinity mask only, paused time left out, the run's own CPU time and its loader workers' not "other"),
and this kernel's per-process CPU times. What a busy process beside a real window comes to on this host is
benchmarks/host_share.py's figure, not a test's: it depends on what else the host runs."""
import multiprocessing
import os
import sys
import time

import pytest
import torch

from common.measure import host as host_mod
from common.measure.host import HostShare, LaunchShare

HZ = os.sysconf("SC_CLK_TCK")


def write_proc(root, cpus: dict, run_delay_ns: int) -> None:
    """cpus: {n: (user, system, idle, steal) in seconds}; the busy columns of /proc/stat are user, nice,
    system, irq and softirq."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]  # the all-CPU line: never read, the per-CPU lines are summed
    for n, (user, system, idle, steal) in sorted(cpus.items()):
        user, system, idle, steal = (round(v * HZ) for v in (user, system, idle, steal))
        lines.append(f"cpu{n} {user} 0 {system} {idle} 0 0 0 {steal} 0 0")
    (root / "stat").write_text("\n".join(lines + ["intr 1 2 3", "ctxt 9"]) + "\n")
    (root / "thread-self").mkdir(exist_ok=True)
    (root / "thread-self" / "schedstat").write_text(f"123456 {run_delay_ns} 7\n")


def test_other_work_steal_and_waits_from_proc_over_the_window_only(tmp_path, monkeypatch):
    ours = {"s": 100.0}
    clock = {"t": 1000.0}
    monkeypatch.setattr(host_mod, "tree_cpu_s", lambda proc=None: ours["s"])
    monkeypatch.setattr(host_mod.time, "perf_counter", lambda: clock["t"])
    monkeypatch.setattr(host_mod.os, "sched_getaffinity", lambda pid: {0, 1})  # cpu2 is another job's
    write_proc(tmp_path, {0: (10, 0, 90, 0), 1: (10, 0, 90, 0), 2: (0, 0, 100, 0)}, run_delay_ns=0)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    # 10 s of window on 2 CPUs: 20 s; 12 s busy, of which the run's 6 s; 1 s stolen; 2 s waited for a CPU
    write_proc(tmp_path, {0: (18, 1, 90, 1), 1: (13, 0, 97, 0), 2: (10, 0, 100, 0)}, run_delay_ns=2 * 10**9)
    ours["s"] += 6
    clock["t"] += 10
    h.step()
    h.pause()
    # an epoch-end checkpoint save on a busy host: not the window's
    write_proc(tmp_path, {0: (50, 1, 90, 1), 1: (50, 0, 97, 0), 2: (10, 0, 100, 0)}, run_delay_ns=9 * 10**9)
    ours["s"] += 1
    clock["t"] += 30
    h.resume()
    # 10 s more, quiet: 10 of 20 s busy, all of it the run's
    write_proc(tmp_path, {0: (55, 6, 90, 1), 1: (50, 0, 107, 0), 2: (10, 0, 100, 0)}, run_delay_ns=9 * 10**9)
    ours["s"] += 10
    clock["t"] += 10
    h.stop()
    row = h.row()
    # other: (12 - 6 + 10 - 10) of 40 s; steal 1 of 40; waits 2 of 20 s
    assert row == {"host_other_pct": 15.0, "host_steal_pct": 2.5, "cpu_wait_pct": 10.0,
                   "notes": "busy host: of its CPUs' time in the window 15.0% other work, 2.5% stolen; the times "
                            "are slower than on a quiet host"}


def test_a_quiet_host_gets_no_note_and_a_host_without_proc_empty_columns(tmp_path, monkeypatch):
    monkeypatch.setattr(host_mod, "tree_cpu_s", lambda proc=None: 0.0)
    write_proc(tmp_path, {0: (10, 0, 90, 0)}, run_delay_ns=0)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    write_proc(tmp_path, {0: (11, 0, 99, 0)}, run_delay_ns=0)
    h.stop()
    row = h.row()
    assert row["host_other_pct"] == 10.0 and "notes" in row  # 1 of 10 s, at BUSY_PCT: noted
    write_proc(tmp_path, {0: (10, 0, 90, 0)}, run_delay_ns=0)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    write_proc(tmp_path, {0: (10.5, 0, 99.5, 0)}, run_delay_ns=0)
    h.stop()
    assert "notes" not in h.row() and h.row()["host_other_pct"] == 5.0
    write_proc(tmp_path, {0: (10, 0, 90, 0)}, run_delay_ns=0)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    write_proc(tmp_path, {0: (10.5, 0, 99, 0.5)}, run_delay_ns=0)  # 5% other and 5% stolen: busy, as busy_pct
    h.stop()
    assert "notes" in h.row() and host_mod.busy_pct(h.row()) == 10.0

    h = HostShare(torch.device("cpu"), proc=str(tmp_path / "nowhere"))  # not Linux's /proc
    h.start()
    h.stop()
    assert h.row() == {"host_other_pct": None, "host_steal_pct": None, "cpu_wait_pct": None}


def test_only_local_rank_0_reads_the_host(tmp_path, monkeypatch):
    """The ranks of a host share its CPUs: each would count the same busy time once more."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    write_proc(tmp_path, {0: (10, 0, 90, 0)}, run_delay_ns=0)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    write_proc(tmp_path, {0: (20, 0, 90, 0)}, run_delay_ns=0)
    h.stop()
    assert h.row()["host_other_pct"] is None  # alone, the rank of a world of one has no host to report


def write_pid(root, pid: int, user: float, system: float) -> None:
    """/proc/PID/stat of a live process: utime and stime are fields 14 and 15 (proc(5)), after a name in
    parentheses that may hold spaces and parentheses of its own."""
    (root / str(pid)).mkdir(exist_ok=True)
    (root / str(pid) / "stat").write_text(f"{pid} (pt_data (worker) 0) S 1 2 3 4 5 6 7 8 9 10 {round(user * HZ)} "
                                          f"{round(system * HZ)} 0 0 20 0 1 0 5 6 7\n")


def fake_times(monkeypatch, now: dict) -> None:
    """os.times() of this process as `now` says: its own user and system seconds, and its reaped children's."""
    monkeypatch.setattr(host_mod.os, "times", lambda: os.times_result(
        (now["user"], now["system"], now["children_user"], now["children_system"], 0.0)))


def test_the_runs_own_threads_and_loader_workers_are_not_other_work(tmp_path, monkeypatch):
    """Over a 10 s window on 2 CPUs: the training thread takes 3 s; loader worker A (2 s before the window)
    ends and is reaped inside it, 2.5 s in all; worker B, still running, goes from 1 to 1.75 s; another
    process takes 4 s. The run's share is 3 + 0.5 + 0.75 s: a reaped worker moves from the live sum to the
    children's whole; 4 of 20 s is other work."""
    from test_window import FakeClock

    now = {"user": 5.0, "system": 1.0, "children_user": 0.5, "children_system": 0.5}
    fake_times(monkeypatch, now)
    live = [101, 102]
    monkeypatch.setattr(host_mod.multiprocessing, "active_children",
                        lambda: [type("Worker", (), {"pid": p})() for p in live])
    monkeypatch.setattr(host_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    clock = FakeClock().install(monkeypatch, host_mod)
    write_proc(tmp_path, {0: (10, 0, 90, 0), 1: (10, 0, 90, 0)}, run_delay_ns=0)
    write_pid(tmp_path, 101, 1.5, 0.5)
    write_pid(tmp_path, 102, 0.75, 0.25)
    h = HostShare(torch.device("cpu"), proc=str(tmp_path))
    h.start()
    now.update(user=7.0, system=2.0, children_user=2.5, children_system=1.0)  # A reaped: its 2.5 s
    live.remove(101)
    write_pid(tmp_path, 102, 1.25, 0.5)
    write_proc(tmp_path, {0: (14.25, 0, 95.75, 0), 1: (14, 0, 96, 0)}, run_delay_ns=10**9)
    clock.sleep(10.0)
    h.stop()
    assert h.ours == pytest.approx(4.25) and h.row() == {
        "host_other_pct": 20.0, "host_steal_pct": 0.0, "cpu_wait_pct": 10.0,
        "notes": "busy host: of its CPUs' time in the window 20.0% other work, 0.0% stolen; the times are slower "
                 "than on a quiet host"}


def test_a_launch_waited_for_owns_its_childrens_time(tmp_path, monkeypatch):
    """calibrate's collectives, seen from the process that launched them: the ranks it reaped (4 s) and its own
    0.2 s are the launch's; 1 s more of busy time on its 2 CPUs over 5 s is other work, 0.5 s stolen."""
    now = {"user": 1.0, "system": 0.0, "children_user": 0.0, "children_system": 0.0}
    fake_times(monkeypatch, now)
    monkeypatch.setattr(host_mod.os, "sched_getaffinity", lambda pid: {0, 1})
    write_proc(tmp_path, {0: (10, 0, 90, 0), 1: (10, 0, 90, 0), 2: (0, 0, 10, 0)}, run_delay_ns=0)
    with LaunchShare(proc=str(tmp_path)) as launch:
        now.update(user=1.2, children_user=3.0, children_system=1.0)
        write_proc(tmp_path, {0: (12.6, 0, 92.4, 0), 1: (12.6, 0, 91.9, 0.5), 2: (5, 0, 10, 0)}, run_delay_ns=0)
    assert (launch.other, launch.steal, launch.pct) == (10.0, 5.0, 15.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_workers_cpu_time_is_read_live_from_proc_and_kept_once_it_is_reaped():
    """This kernel's /proc/PID/stat and os.times(), with a forked worker that spins until its own CPU clock
    passes 0.2 s: its time is at least that (less a clock tick per field) on any host, however busy, where
    only the wall time it takes grows."""
    ctx = multiprocessing.get_context("fork")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=_spin_cpu, args=(0.2, theirs))
    before = host_mod.tree_cpu_s()
    worker.start()
    try:
        assert ours.poll(60) and ours.recv() == "spun"
        alive = host_mod._pid_cpu_s(worker.pid)
        during = host_mod.tree_cpu_s()
        ours.send("exit")
        worker.join(60)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()
    after = host_mod.tree_cpu_s()
    tick = 1 / HZ + 1e-9  # what truncating a time to clock ticks may take off one field (utime, stime)
    # sums of tick multiples in floats: 1.48 - 1.29 < 0.19 (the parent waited in poll() and added no tick)
    assert alive >= 0.2 - 2 * tick and during - before >= alive - 1e-9, (alive, before, during)
    assert after >= during - 2 * tick, (during, after)  # reaped: its time moved to os.times()' children, whole


def _spin_cpu(seconds: float, conn) -> None:
    while time.process_time() < seconds:
        pass
    conn.send("spun")
    conn.recv()


# --- launching again on a busy host: calibrate's entries and collectives, the matrix's launches ---


def test_calibrate_draws_an_entry_again_while_the_host_was_busy(monkeypatch, capsys):
    from common.bench import calibrate as cal

    busy = iter([35.6, 12.0, 1.0])
    draws = []

    def draw():
        draws.append(1)
        b = next(busy)
        return {"fwd_ms": float(len(draws))}, {"_busy_pct": b, "host_other_pct": "0.6", "host_steal_pct": str(b - 0.6)}

    got = cal._rounds([("k", draw, False)], 1, relaunch=2)["k"]
    assert got[0] == {"fwd_ms": 3.0} and len(draws) == 3  # the third draw, on a quiet host
    out = capsys.readouterr().out
    assert "compute k: the host was busy (35.6% of its CPU time: 0.6% other work, 35.0% stolen)" in out
    assert "launched again (2 of 2)" in out
    busy, draws[:] = iter([35.6, 20.0]), []
    assert cal._rounds([("k", draw, False)], 1, relaunch=1)["k"][0] == {"fwd_ms": 2.0}  # out of relaunches: kept
    assert "kept, busy" in capsys.readouterr().out
    busy, draws[:] = iter([35.6]), []
    assert cal._rounds([("k", draw, False)], 1)["k"][0] == {"fwd_ms": 1.0}  # relaunch 0: every draw is kept


def test_calibrate_launches_the_collectives_again_while_the_host_was_busy(monkeypatch):
    """benchmarks/collectives.py writes no row: the launch's share is seen from calibrate's process."""
    from common.bench import calibrate as cal

    shares = iter([50.0, None])

    class Share:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.pct = self.other = next(shares)
            self.steal = 0.0

    launched = []
    monkeypatch.setattr(cal, "LaunchShare", Share)
    monkeypatch.setattr(cal, "_collectives_once", lambda *a: launched.append(a) or {("all_reduce", 1): 0.1})
    assert cal._collectives(2, "cpu", 1, "8M", "256", relaunch=2) == {("all_reduce", 1): 0.1}
    assert len(launched) == 2  # busy, then a host without /proc/stat (None): kept


def test_the_matrix_launches_a_busy_launch_again_and_the_report_says_so(tmp_path, monkeypatch, capsys):
    import argparse

    from common.bench import matrix
    from common.report import write_report
    from common.results import append_row

    results = str(tmp_path / "s.csv")
    steal = iter([30.0, 0.5, 40.0, 45.0])

    def execute(run, i, n, gpus, results_, log_dir, t0):
        row = {"script": "pytorch_DDP.py", "status": "ok", "device_name": "X", "run_name": run["name"],
               "repeat": run["args"]["repeat"], "step_ms_p50": 100.0, "step_ms_mean": 100.0, "host_other_pct": 0.0,
               "host_steal_pct": next(steal), "throughput_img_s": 10.0}
        append_row(results_, row)
        return 0, "ok", [], row  # the row as the run's --figures JSON gives it

    monkeypatch.setattr(matrix, "hardware", lambda: (0, "X"))
    monkeypatch.setattr(matrix, "execute", execute)
    runs = [{"name": "t/ddp", "script": "pytorch_DDP.py", "args": {}, "gpu_only": False, "timeout_s": 60}]
    opts = argparse.Namespace(preset="p", only="", matrix="", runs=runs, results=results, force=False, dry_run=False,
                              log_dir=str(tmp_path), repeats=2, relaunch_busy=1, world_sizes="")
    assert matrix.run_matrix(opts) == 0
    got = [(r["repeat"], r["host_steal_pct"]) for r in matrix.read_rows(results)]
    assert got == [("1", "30.0"), ("1", "0.5"), ("2", "40.0"), ("2", "45.0")]  # launch 2: busy twice, kept
    out = capsys.readouterr().out
    assert out.count("launched again (1 of 1)") == 2 and out.count("kept, busy") == 1
    write_report(results, str(tmp_path / "R.md"))
    text = (tmp_path / "R.md").read_text()
    assert "On a busy host" in text and "t/ddp launch 2: 100.0 ms, 0.0% other work, 45.0% stolen" in text
    again = next(ln for ln in text.splitlines() if ln.startswith("Launched again after a busy host"))
    assert "t/ddp launch 1: 100.0 ms, 0.0% other work, 30.0% stolen" in again
    assert "t/ddp launch 2: 100.0 ms, 0.0% other work, 40.0% stolen" in again
    assert "| 45.0 | busy host |" in text  # the repeats table: the largest share of the launches read

    def failing(run, i, n, gpus, results_, log_dir, t0):  # a relaunch that fails keeps the busy launch
        if run["args"]["repeat"] == 3 and len(matrix.read_rows(results)) == 5:
            return 1, "failed", ["boom"], None
        return execute(run, i, n, gpus, results_, log_dir, t0)

    steal = iter([50.0])
    monkeypatch.setattr(matrix, "execute", failing)
    assert matrix.run_matrix(argparse.Namespace(**{**vars(opts), "repeats": 3})) == 0
    assert [r["status"] for r in matrix.read_rows(results)][4:] == ["ok"]  # no failed row after it
    assert "the launch again did not end ok: the busy launch is kept" in capsys.readouterr().out
