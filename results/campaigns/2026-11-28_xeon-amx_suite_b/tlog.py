"""A pytest plugin (PYTHONPATH=<this folder> pytest -p tlog): each test's start and end times into $TLOG."""
import time, os
_f = open(os.environ.get("TLOG", "/tmp/tlog.txt"), "w", buffering=1)
def pytest_runtest_logstart(nodeid, location):
    _f.write(f"start {time.time():.3f} {nodeid}\n")
def pytest_runtest_logfinish(nodeid, location):
    _f.write(f"end {time.time():.3f} {nodeid}\n")
