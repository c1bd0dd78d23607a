import subprocess, collections, re
rec = []
for ln in subprocess.run(["dump-acct", "/var/log/acct_suite"], capture_output=True, text=True).stdout.splitlines():
    f = [x.strip() for x in ln.split("|")]
    rec.append(dict(comm=f[0], cpu=(float(f[2])+float(f[3]))/100, e=float(f[4])/100, pid=int(f[9]), ppid=int(f[10])))
par = {r["pid"]: r for r in rec}
starts = {}
for ln in open("/tmp/acct/starts.log"):
    t, pid, ppid, test, argv = ln.rstrip("\n").split("\t")
    starts[int(pid)] = (test, argv)
main = min(starts, key=lambda p: 0)  # first line
first = open("/tmp/acct/starts.log").readline().split("\t")[1]
def owner(pid):
    chain = []
    for _ in range(30):
        if pid in starts and starts[pid][0]:
            return starts[pid][0].split(" (")[0]
        if pid in starts: chain.append(starts[pid][1])
        if pid not in par: break
        pid = par[pid]["ppid"]
    return "shared:" + (chain[-1][:60] if chain else "?")
agg = collections.Counter(); byfile = collections.Counter(); total = 0
for r in rec:
    if str(r["pid"]) == first: 
        print("pytest main process cpu", r["cpu"]); continue
    o = owner(r["pid"])
    agg[o] += r["cpu"]; total += r["cpu"]
    byfile[o.split("::")[0] if not o.startswith("shared") else "shared launches"] += r["cpu"]
print("children total", total)
for k, v in byfile.most_common(40): print(f"{v:7.1f} {k}")
print()
for k, v in agg.most_common(40): print(f"{v:7.1f} {k[:150]}")
print("\n--- shared launches by top argv")
tops = collections.Counter(); cnt = collections.Counter()
def top(pid):
    chain = []
    for _ in range(30):
        if pid in starts: chain.append((pid, starts[pid]))
        if pid not in par: break
        pid = par[pid]["ppid"]
    # the outermost non-pytest python
    for p, (t, a) in reversed(chain):
        if "pytest" not in a and "-p tlog" not in a:
            return t, a
    return "?", "?"
for r in rec:
    o = owner(r["pid"])
    if "test_no_file_is_lost" in o or o.startswith("shared"):
        t, a = top(r["pid"])
        a = re.sub(r"--(results|save-dir|log-dir|master_port|rdzv[-_]endpoint)[= ]\S+", "", a)
        a = re.sub(r"/tmp/\S+", "", a)
        tops[a[:200]] += r["cpu"]
for k, v in tops.most_common(60): print(f"{v:6.1f} {k}")
print(len(tops))
