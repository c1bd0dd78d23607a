import torch, time, sys, os
t = torch.randn(86_000_000)
for d in sys.argv[1:]:
    for i in range(3):
        t0 = time.time(); ru0 = os.times()
        torch.save({'a': t, 'b': t.clone()}, f'{d}/x{i}.pt')
        ru1 = os.times()
        print(d, i, f"wall {time.time()-t0:.2f} sys {ru1.system-ru0.system:.2f}", flush=True)
    for i in range(3): os.remove(f'{d}/x{i}.pt')
