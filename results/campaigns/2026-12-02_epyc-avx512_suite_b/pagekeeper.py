"""Holds in memory the library pages every process of the suite loads, while the suite runs: this campaign's
experiment, not part of the suite (README.md: it saved only a cold start's first minute). Run by hand from the
checkout's root, beside the tests: `python <this file> $$ &` (the argument: the pid whose death stops it).

Some VMs page out page cache that has gone unused for a while: the 2-core EPYC VM of this campaign runs DAMON with a `pageout`
scheme on physical memory (/sys/kernel/mm/damon/admin/kdamonds/*/contexts/*/schemes/*/action) that reclaims
regions idle for 12 aggregation intervals of 5 s, a minute. A launch touches most of its import pages only
while it starts, so they go cold before the next launch of that kind, which then reads them again from a disk
that served reads at a few MB/s there: `import torch, torchvision` took 13.3 s a minute after the last one
(42 MB read, 8.7 core-s of iowait) and 4.2 s right after it.

This process imports what the scripts import (each script's module body, with no __main__), then locks with
mlock(2) the pages its imports touched: every compiled module file it read, whole, and of each shared library
it mapped, the pages present in its page tables (/proc/self/pagemap bit 63): a launch's import set, never the
rest of a multi-GB CUDA library. Locked pages are not reclaimed, and they are the page-cache pages every later
process maps and reads. It then sleeps until its parent (the pid given) ends, or SIGTERM. Where mlock is
refused (no CAP_IPC_LOCK, a small RLIMIT_MEMLOCK) it locks what it may and says how much it could not.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import mmap
import os
import re
import signal
import sys

ROOT = os.getcwd()  # the checkout
PAGE = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
MAP_FAILED = ctypes.c_void_p(-1).value
PR_SET_PDEATHSIG = 1


def import_the_scripts() -> None:
    """Each top-level script's imports (its module body up to `if __name__ == "__main__"`), and what the ZeRO
    engine imports when it starts (deepspeed/runtime/zero/utils.py is_zero_supported_optimizer)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    sys.path.insert(0, ROOT)
    for path in sorted(glob.glob(os.path.join(ROOT, "*.py"))):
        spec = importlib.util.spec_from_file_location(f"_keep_{os.path.basename(path)[:-3]}", path)
        try:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        except BaseException:  # noqa: BLE001 - a script this machine cannot import locks nothing of its own
            pass
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except BaseException:  # noqa: BLE001
        pass


def read_files() -> set[str]:
    """What importing a module read: its compiled file, or its source where it has none (PYTHONDONTWRITEBYTECODE);
    an extension module is a shared library (lock_libraries)."""
    files = set()
    for m in list(sys.modules.values()):
        spec = getattr(m, "__spec__", None)
        for path in (getattr(spec, "cached", None), getattr(m, "__file__", None)):
            if path and path.endswith((".pyc", ".py")) and os.path.isfile(path):
                files.add(path)
                break
    return files


def lock_file(path: str) -> int:
    """The whole file, mapped and locked; its size, or 0."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return 0
    try:
        size = os.fstat(fd).st_size
        if not size:
            return 0
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, MAP_FAILED):
            return 0
        return size if libc.mlock(addr, size) == 0 else 0
    finally:
        os.close(fd)


def lock_present(start: int, end: int, pagemap) -> tuple[int, int]:
    """The pages of [start, end) present in this process's page tables: (bytes locked, bytes refused)."""
    pagemap.seek(start // PAGE * 8)
    entries = pagemap.read((end - start) // PAGE * 8)
    locked = refused = 0
    run = None
    for i in range(len(entries) // 8 + 1):
        present = i < len(entries) // 8 and entries[8 * i + 7] & 0x80
        if present and run is None:
            run = i
        elif not present and run is not None:
            n = (i - run) * PAGE
            if libc.mlock(start + run * PAGE, n) == 0:
                locked += n
            else:
                refused += n
            run = None
    return locked, refused


def lock_libraries() -> tuple[int, int]:
    locked = refused = 0
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb", buffering=0) as pagemap:
        for line in maps:
            m = re.match(r"([0-9a-f]+)-([0-9a-f]+) \S+ \S+ \S+ \d+\s+(/\S+\.so[.\d]*)$", line.strip())
            if m:
                got = lock_present(int(m.group(1), 16), int(m.group(2), 16), pagemap)
                locked, refused = locked + got[0], refused + got[1]
    return locked, refused


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    # gone with the suite, however it ends (SIGKILL included): SIGTERM when the parent dies (prctl(2))
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != int(sys.argv[1]):  # the parent died before the prctl
        return
    import_the_scripts()
    modules = sum(lock_file(p) for p in read_files())
    libs, refused = lock_libraries()
    print(f"pagekeeper: {modules / 1e6:.0f} MB of compiled modules and {libs / 1e6:.0f} MB of shared libraries "
          f"locked in memory" + (f", {refused / 1e6:.0f} MB refused (mlock)" if refused else ""), flush=True)
    signal.pause()


if __name__ == "__main__":
    main()
