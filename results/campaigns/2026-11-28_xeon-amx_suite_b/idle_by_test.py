"""Idle core-seconds per test of a suite run: python idle_by_test.py STAT TLOG, where STAT holds a line
"<epoch s> <the first line of /proc/stat>" every 0.5 s and TLOG is what tlog.py wrote (pytest -p tlog)."""
import sys
# /proc/stat samples: t cpu user nice system idle iowait irq softirq steal ...
samples = []
for ln in open(sys.argv[1]):
    p = ln.split()
    if len(p) < 10: continue
    t = float(p[0]); v = list(map(int, p[2:]))
    idle = v[3] + v[4]; total = sum(v[:8])
    samples.append((t, idle, total))
def busy(t0, t1):
    """cores busy on average over [t0, t1] (2 cores)"""
    pts = [s for s in samples if t0 <= s[0] <= t1]
    if len(pts) < 2: return None
    a, b = pts[0], pts[-1]
    dt = b[2] - a[2]
    return 2 * (1 - (b[1] - a[1]) / dt) if dt else None
tests = {}
for ln in open(sys.argv[2]):
    kind, t, node = ln.split(" ", 2); node = node.strip()
    tests.setdefault(node, {})[kind] = float(t)
rows = []
for node, d in tests.items():
    if "start" in d and "end" in d:
        dur = d["end"] - d["start"]
        b = busy(d["start"], d["end"])
        if b is not None and dur > 3:
            rows.append((dur * (2 - b), dur, b, node))
rows.sort(reverse=True)
tot_idle = sum(r[0] for r in rows)
print(f"idle core-seconds in tests > 3 s: {tot_idle:.0f}")
for r in rows[:45]:
    print(f"{r[0]:6.1f} idle core-s  {r[1]:6.1f} s  busy {r[2]:.2f}  {r[3]}")
t0, t1 = samples[0][0], samples[-1][0]
print("overall busy", round(busy(t0, t1), 2), "over", round(t1 - t0), "s")
