"""The host's share of the timed window (common/measure/host.py): /proc read from a fake tree (the CPUs of
the affinity mask only, paused time left out, the run's own CPU time not "other"), and on this host a busy
process beside the window against the run's own threads and loader workers."""
import multiprocessing
import os
import subprocess
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


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _window(work) -> dict:
    h = HostShare(torch.device("cpu"))
    h.start()
    work()
    h.stop()
    return h.row()


@pytest.mark.alone  # a launch beside it would be other work
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_a_busy_process_beside_the_window_is_other_work_and_the_runs_own_is_not():
    """On 2 CPUs (this process and its children pinned there): one busy process beside the window is half of them."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus[:2])  # inherited by the children forked and started below
    try:
        _busy_beside()
    finally:
        os.sched_setaffinity(0, before)


def _busy_beside():
    ctx = multiprocessing.get_context("fork")
    live = ctx.Process(target=_spin, args=(30,))

    def own():  # the training thread and two loader workers: one that ends in the window, one still running
        ended = ctx.Process(target=_spin, args=(0.25,))
        ended.start()
        live.start()
        _spin(0.5)
        ended.join()

    try:
        quiet = _window(own)
    finally:
        live.kill()
        live.join()
    # a launch seen from the process that waited for it (calibrate's collectives): its child's time is its own
    with LaunchShare() as launch:
        subprocess.run([sys.executable, "-c", SPIN.format(0.4)], check=True)
    busy = subprocess.Popen([sys.executable, "-c", SPIN.format(30)])
    try:
        time.sleep(0.3)  # its start-up (python's) is busy too, but not yet the window's
        loaded = _window(lambda: (_spin(0.4), time.sleep(0.4)))
    finally:
        busy.kill()
        busy.wait()
    # quiet: two cores busy with the run's own work; loaded: one with the run's for half the window, one with
    # the other process's for all of it (half of the host's time; the hypervisor may take some)
    assert quiet["host_other_pct"] < 10.0, quiet
    assert launch.pct is not None and launch.pct < 10.0, launch.pct
    assert loaded["host_other_pct"] > 30.0 and "busy host" in loaded["notes"], loaded


SPIN = "import time\nt = time.time() + {}\nwhile time.time() < t: pass"


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
        append_row(results_, {"script": "pytorch_DDP.py", "status": "ok", "device_name": "X", "run_name": run["name"],
                              "repeat": run["args"]["repeat"], "step_ms_p50": 100.0, "step_ms_mean": 100.0,
                              "host_other_pct": 0.0, "host_steal_pct": next(steal), "throughput_img_s": 10.0})
        return 0, "ok", []

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
            return 1, "failed", ["boom"]
        return execute(run, i, n, gpus, results_, log_dir, t0)

    steal = iter([50.0])
    monkeypatch.setattr(matrix, "execute", failing)
    assert matrix.run_matrix(argparse.Namespace(**{**vars(opts), "repeats": 3})) == 0
    assert [r["status"] for r in matrix.read_rows(results)][4:] == ["ok"]  # no failed row after it
    assert "the launch again did not end ok: the busy launch is kept" in capsys.readouterr().out
