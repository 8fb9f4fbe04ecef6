import json, sys, collections
r = json.load(open(sys.argv[1]))
ar = r["steps"]["ar"]; ar_rate = sum(s["emitted"] for s in ar)/sum(s["seconds"] for s in ar)
for name, steps in r["steps"].items():
    c = collections.defaultdict(list)
    for s in steps: c[s["verified"]].append(s)
    tot = sum(s["emitted"] for s in steps)/sum(s["seconds"] for s in steps)
    print(name, f"{tot:.2f} tok/s {tot/ar_rate:.3f}x")
    for k in sorted(c):
        ss = c[k]; n=len(ss)
        f = lambda key: sum(s["stages"][key] for s in ss)/n*1000
        em = sum(s["emitted"] for s in ss)/n; sec = sum(s["seconds"] for s in ss)/n
        print(f"  v{k}: n {n} tok {em:.2f} pred {sum(s['predicted_tokens'] or 0 for s in ss)/n:.2f} ms {sec*1000:.1f} (fw {f('forward'):.1f} pred_s {sum(s['predicted_seconds'] or 0 for s in ss)/n*1000:.1f} prop {f('propose'):.1f}) tok/s {em/sec:.1f}")
    if name != "ar":
        print("  ", "".join(str(min(s["verified"],9)) for s in steps))
