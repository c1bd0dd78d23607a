import json, collections, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
c = collections.Counter(); s = collections.Counter(); n = collections.Counter()
for r in rows:
    a = r["argv"]
    key = ("vit " if "vit_b_16" in a or "pytorch_TP" in a else "") + (a.split()[0].split("/")[-1] if a else "?")
    c[key] += r["cpu"]; s[key] += r["sys"]; n[key] += 1
for k, v in c.most_common(40):
    print(f"{v:7.1f} sys {s[k]:6.1f} n {n[k]:3d} {k}")
