"""The process logger of this campaign: every Python process appends one JSON line to /tmp/pstarts.log at exit
(pid, parent, start, wall s, CPU s of its own and of its reaped children, PYTEST_CURRENT_TEST, argv) when
PSTART_LOG is set. Installed as site-packages/zz_pstart_mod.py with a zz_pstart.pth holding `import
zz_pstart_mod`; removed after. A process killed by a signal writes nothing."""
import os

if os.environ.get("PSTART_LOG"):
    import atexit
    import json
    import resource
    import sys
    import time

    _t0 = time.time()

    def _log():
        try:
            r = resource.getrusage(resource.RUSAGE_SELF)
            c = resource.getrusage(resource.RUSAGE_CHILDREN)
            with open("/tmp/pstarts.log", "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "t0": _t0, "wall": time.time() - _t0,
                                    "cpu": r.ru_utime + r.ru_stime, "child_cpu": c.ru_utime + c.ru_stime,
                                    "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                                    "argv": " ".join(sys.argv)[:300]}) + "\n")
        except Exception:
            pass

    atexit.register(_log)
