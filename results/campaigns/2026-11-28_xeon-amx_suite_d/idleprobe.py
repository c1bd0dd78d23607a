"""Samples /proc/stat twice a second: idle core-seconds per running test and phase, launches in flight."""
import os, threading, time
CUR = ["-", "-"]
OUT = open(os.environ.get("IDLEPROBE_OUT", "/tmp/idle.tsv"), "w", buffering=1)
HZ = os.sysconf("SC_CLK_TCK")

def _stat():
    f = open("/proc/stat").readline().split()[1:]
    v = list(map(int, f))
    idle = v[3] + v[4]
    return idle, sum(v[:8])

def _loop():
    try:
        import launches
    except Exception:
        launches = None
    pi, pt = _stat(); t0 = time.time()
    while True:
        time.sleep(0.5)
        i, t = _stat()
        fl = -1
        a = getattr(launches, "ACTIVE", None) if launches else None
        if a is not None:
            try:
                fl = sum(not f.done() for f in list(a.futures.values()))
            except Exception:
                pass
        OUT.write(f"{time.time()-t0:.1f}\t{(i-pi)/HZ:.2f}\t{(t-pt)/HZ:.2f}\t{fl}\t{CUR[1]}\t{CUR[0]}\n")
        pi, pt = i, t

def pytest_sessionstart(session):
    threading.Thread(target=_loop, daemon=True).start()

def pytest_runtest_logstart(nodeid, location):
    CUR[0] = nodeid; CUR[1] = "setup"

def pytest_runtest_setup(item):
    CUR[1] = "setup"

def pytest_runtest_call(item):
    CUR[1] = "call"

def pytest_runtest_teardown(item):
    CUR[1] = "teardown"
