"""What the host-share columns (common/measure/host.py) read on this host, for three windows on 2 CPUs:

    python benchmarks/host_share.py

  own       the training thread busy 0.5 s, with two loader workers that spin beside it (one ends inside the
            window, one is still running at its end): all the run's own, host_other_pct near 0
  launch    a process started and waited for (calibrate's collectives, seen by LaunchShare): its time is
            the launcher's own, near 0
  loaded    a busy process started before the window and running through it, the training thread busy
            for half of the window: the other process holds half the CPUs' time, host_other_pct near 50

Figures, not checks: whatever else runs on the host (a test suite, a build, the hypervisor's other guests)
adds to each, which is what the columns are there to show. tests/test_host.py checks the arithmetic on a
fake /proc tree, and this kernel's per-process CPU times.
"""
import argparse
import multiprocessing
import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common.measure.host import HostShare, LaunchShare  # noqa: E402

SPIN = "import time\nt = time.time() + {}\nwhile time.time() < t: pass"


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def window(work) -> dict:
    h = HostShare(torch.device("cpu"))
    h.start()
    work()
    h.stop()
    return h.row()


def own() -> dict:
    ctx = multiprocessing.get_context("fork")
    live = ctx.Process(target=spin, args=(30,))

    def work():
        ended = ctx.Process(target=spin, args=(0.25,))
        ended.start()
        live.start()
        spin(0.5)
        ended.join()

    try:
        return window(work)
    finally:
        live.kill()
        live.join()


def launch() -> float | None:
    with LaunchShare() as share:
        subprocess.run([sys.executable, "-c", SPIN.format(0.4)], check=True)
    return share.pct


def loaded() -> dict:
    busy = subprocess.Popen([sys.executable, "-c", SPIN.format(30)])
    try:
        time.sleep(0.3)  # its start-up (python's) is busy too, but not yet the window's
        return window(lambda: (spin(0.4), time.sleep(0.4)))
    finally:
        busy.kill()
        busy.wait()


def main():
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    if not sys.platform.startswith("linux"):
        sys.exit("host_share.py: reads Linux's /proc")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit(f"host_share.py: needs 2 CPUs, this process may use {len(cpus)}")
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus[:2])  # inherited by the children forked and started below
    try:
        quiet, launched, busy = own(), launch(), loaded()
    finally:
        os.sched_setaffinity(0, before)
    print(f"CPUs {cpus[:2]}: own work {quiet['host_other_pct']}% other (steal {quiet['host_steal_pct']}%); "
          f"a launch waited for {launched}%; a busy process beside {busy['host_other_pct']}% other "
          f"(steal {busy['host_steal_pct']}%)")


if __name__ == "__main__":
    main()
