"""The host's share of the timed window: whether the run had its CPUs to itself while it was timed.

A step time is only as good as the host it ran on: on a 2-core VM, two launches of the same FSDP run
half an hour apart measured median steps of 632 and 1415 ms, the second with a third of its CPU time
stolen by the hypervisor. These columns tell whether a slow launch lost its CPUs to something else. On a
GPU host they show a busy host slowing the launches and the loader.

    host_other_pct  the share of the CPU time of the run's CPUs (its affinity mask) that went to work
                    which was not the run's: other processes (a build, another benchmark, a test
                    runner), the launcher, the kernel's softirqs of other work. It is busy time from
                    /proc/stat's per-CPU lines, minus the CPU time of the ranks' own process trees
                    (os.times(): every thread, reaped children; and the live children
                    multiprocessing started, the DataLoader's workers, from /proc/PID/stat).
    host_steal_pct  the share of those CPUs' time that the hypervisor gave to other guests while this
                    guest had work to run (/proc/stat's steal column; proc(5)). 0 on bare metal.
    cpu_wait_pct    the share of the window the rank's training thread was runnable but waited for a
                    CPU: the second field of /proc/thread-self/schedstat, its run-queue delay in ns
                    (Documentation/scheduler/sched-stats.rst). Max over ranks. It counts waits behind
                    the run's own threads too (gloo's, the loader's, another rank on the same core): on a
                    CPU run it is part of what the step costs, on a GPU host a rank starved of a core.

host_* are host-wide, read by local rank 0 of each host over the CPUs it may run on, and summed over
hosts (each host's window is its local rank 0's). Empty where /proc is not Linux's. The counters are
read when the window opens, pauses, resumes and stops: a few small files, inside the window's first and
last steps (a read 0.035 ms on the 2-CPU Xeon; /proc/stat has a line per CPU). A run whose host was busy
(other work plus steal from BUSY_PCT, as busy_pct counts) gets a note. Local rank 0's affinity mask stands
for its host's ranks: ranks pinned to other CPUs (DeepSpeed's --bind_cores_to_rank) spend time outside it,
which is then taken off its busy time, and host_other_pct comes out low.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from typing import TYPE_CHECKING

from . import Instrument

if TYPE_CHECKING:  # torch and the process group are the instrument's: the report and benchmark.py's driver read
    import torch  # this module's row functions without importing torch (2-3 s a process)

PROC = "/proc"
# from this share of other work plus steal, the row's notes say its times are a busy host's: the time preset's
# launches on the 2-core Xeon VM found 0-3% other work and 0.1-4.6% steal in quiet spells, 7-36% steal in a
# busy one, whose launches were up to 2.1x slower (docs/time.md, A busy host)
BUSY_PCT = 10.0


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_lines(proc: str = PROC, cpus: set[int] | None = None) -> tuple[float, float, float] | None:
    """(busy, steal, total) seconds summed over `cpus` (all when None) from /proc/stat, None if unreadable.
    Busy is user, nice, system, irq and softirq; idle and iowait are idle; guest time is inside user."""
    try:
        with open(os.path.join(proc, "stat")) as fh:
            lines = [ln.split() for ln in fh if ln.startswith("cpu") and ln[3:4].isdigit()]
    except OSError:
        return None
    busy = steal = total = 0
    for f in lines:
        if cpus is not None and int(f[0][3:]) not in cpus:
            continue
        v = [int(x) for x in f[1:9]]
        user, nice, system, idle, iowait, irq, softirq, st = v + [0] * (8 - len(v))  # steal: Linux 2.6.11+
        busy += user + nice + system + irq + softirq
        steal += st
        total += user + nice + system + idle + iowait + irq + softirq + st
    hz = _ticks_per_s()
    return (busy / hz, steal / hz, total / hz) if total else None


def _pid_cpu_s(pid: int, proc: str = PROC) -> float:
    """utime + stime of a live process, 0 when it is gone (proc(5): fields 14 and 15)."""
    try:
        with open(os.path.join(proc, str(pid), "stat")) as fh:
            fields = fh.read().rsplit(")", 1)[1].split()  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _ticks_per_s()


def tree_cpu_s(proc: str = PROC) -> float:
    """CPU seconds of this process (every thread), of the children it reaped, and of the live children
    multiprocessing started (the DataLoader's workers): a worker alive at one read and reaped by the next
    moves from the live sum to the reaped one whole, so the difference between two reads stays its share."""
    t = os.times()
    live = sum(_pid_cpu_s(p.pid, proc) for p in multiprocessing.active_children() if p.pid)
    return t.user + t.system + t.children_user + t.children_system + live


def run_delay_s(proc: str = PROC) -> float | None:
    """This thread's time runnable but waiting for a CPU, None without schedstats."""
    try:
        with open(os.path.join(proc, "thread-self", "schedstat")) as fh:
            return int(fh.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def affinity() -> set[int] | None:
    """The CPUs this process may run on (its host's share is theirs); None where the platform cannot say."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None


def shares(busy: float, steal: float, total: float, ours: float) -> tuple[float, float] | None:
    """(other work, steal) as % of the CPUs' time, to 0.1: their busy time less the run's own, and the
    hypervisor's; None for no time to share out (no host read, or less than a clock tick)."""
    if not total:
        return None
    return round(max(0.0, 100 * (busy - ours) / total), 1), round(100 * steal / total, 1)


def is_busy(pct) -> bool:
    """busy_pct's figure (or its pandas column) at or above BUSY_PCT: the host's rule, for the row's note,
    calibrate's and the matrix's relaunch, and the report's flags."""
    return pct is not None and pct >= BUSY_PCT


def describe(other, steal) -> str:
    """The host's share in words, as every message about a busy host puts it."""
    def pct(v):
        return "?" if v in (None, "") or v != v else f"{float(v):.1f}"
    return f"{pct(other)}% other work, {pct(steal)}% stolen"


def busy_pct(row: dict) -> float | None:
    """A row's share of its host's CPU time that was not the run's (other work plus steal), %; None for a row
    that measured neither."""
    got = [float(row[c]) for c in ("host_other_pct", "host_steal_pct") if row.get(c) not in (None, "")]
    return sum(got) if got else None


class LaunchShare:
    """The host's share of a launch, seen from the process that started it and waited for it: busy and
    stolen time of its CPUs over the launch, less this process's and its reaped descendants' CPU time
    (os.times' children counts every descendant its parent waited for). The whole launch (imports and
    set-up too), where a row's columns hold its timed window only. After the with-block: `other` and `steal`,
    % (None where /proc/stat is unreadable), and `pct`, their sum."""

    def __init__(self, proc: str = PROC):
        self.proc, self.pct, self.other, self.steal = proc, None, None, None
        self.cpus = affinity()

    def _read(self):
        t = os.times()
        return cpu_lines(self.proc, self.cpus), t.user + t.system + t.children_user + t.children_system

    def __enter__(self):
        self.before = self._read()
        return self

    def __exit__(self, *exc):
        (lines0, ours0), (lines1, ours1) = self.before, self._read()
        if lines0 is not None and lines1 is not None:
            got = shares(*(b - a for a, b in zip(lines0, lines1)), ours1 - ours0)
            if got:
                self.other, self.steal = got
                self.pct = round(self.other + self.steal, 1)
        return False


class HostShare(Instrument):
    def __init__(self, run_device: torch.device, proc: str = PROC):
        from ..distributed import local_rank

        self.run_device, self.proc = run_device, proc
        self.owner = local_rank() == 0  # the ranks of a host share its CPUs: one reads them
        self.cpus = affinity()
        self.busy = self.steal = self.total = self.ours = self.delay = self.wall = 0.0
        self.readable = self.owner and cpu_lines(proc, self.cpus) is not None
        self.waits = run_delay_s(proc) is not None
        self.last = None
        self.thread = None

    def _read(self):
        return (cpu_lines(self.proc, self.cpus) if self.readable else None, tree_cpu_s(self.proc),
                run_delay_s(self.proc) if self.waits else None, time.perf_counter())

    def start(self) -> None:
        self.thread = threading.get_native_id()  # the thread the hooks run on: the training loop's
        self.last = self._read()

    resume = start

    def pause(self) -> None:
        if self.last is None:
            return
        now = self._read()
        (lines0, ours0, delay0, t0), (lines1, ours1, delay1, t1) = self.last, now
        if lines0 is not None and lines1 is not None:
            self.busy += lines1[0] - lines0[0]
            self.steal += lines1[1] - lines0[1]
            self.total += lines1[2] - lines0[2]
        self.ours += ours1 - ours0
        if delay0 is not None and delay1 is not None and threading.get_native_id() == self.thread:
            self.delay += delay1 - delay0
            self.wall += t1 - t0
        self.last = None

    stop = pause

    def row(self) -> dict:
        from ..distributed import reduce_metrics

        host = {"busy": self.busy, "steal": self.steal, "total": self.total} if self.readable else {}
        summed = reduce_metrics({"busy": host.get("busy"), "steal": host.get("steal"), "total": host.get("total"),
                                 "ours": self.ours}, self.run_device, "sum")
        wait = reduce_metrics({"wait": 100 * self.delay / self.wall if self.waits and self.wall else None},
                              self.run_device, "max")["wait"]
        other, steal = shares(summed["busy"], summed["steal"], summed["total"], summed["ours"]) or (None, None)
        row = {"host_other_pct": other, "host_steal_pct": steal,
               "cpu_wait_pct": None if wait is None else round(wait, 1)}
        if is_busy(busy_pct(row)):
            row["notes"] = (f"busy host: of its CPUs' time in the window {describe(other, steal)}; the times are "
                            "slower than on a quiet host")
        return row
