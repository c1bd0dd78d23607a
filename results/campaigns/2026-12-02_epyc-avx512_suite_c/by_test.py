import json, collections, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
def io(r):
    return {k: int(v) for k, v in (l.split(": ") for l in r["io"].strip().splitlines())}
for r in rows: r["wb"] = io(r)["write_bytes"]; r["wc"] = io(r)["wchar"]
kids = collections.defaultdict(int); kidsc = collections.defaultdict(int)
for r in rows: kids[r["ppid"]] += r["wb"]; kidsc[r["ppid"]] += r["wc"]
for r in rows: r["self_wb"] = max(0, r["wb"] - kids[r["pid"]]); r["self_wc"] = max(0, r["wc"] - kidsc[r["pid"]])
print("processes", len(rows), "cpu", round(sum(r["cpu"] for r in rows)), "sys", round(sum(r["sys"] for r in rows)),
      "self write_bytes GB", round(sum(r["self_wb"] for r in rows) / 2**30, 2))
by = collections.defaultdict(collections.Counter)
for r in rows:
    t = r["test"].split(" ")[0] if r["test"] else "(none)"
    by[t]["wb"] += r["self_wb"] / 2**20; by[t]["cpu"] += r["cpu"]; by[t]["sys"] += r["sys"]; by[t]["n"] += 1
for t, c in sorted(by.items(), key=lambda kv: -kv[1]["wb"])[:20]:
    print(f"{c['wb']:7.0f} MB sys {c['sys']:6.1f} cpu {c['cpu']:6.1f} n {c['n']:3d} {t[:110]}")
