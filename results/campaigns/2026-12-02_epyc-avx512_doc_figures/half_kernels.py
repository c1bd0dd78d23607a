"""Training-step throughput of fp32 against bf16 (autocast and pure) on this CPU, in one process per case:
  python half_kernels.py MODEL SIZE BATCH MODE   (MODE: fp32 | amp_bf16 | pure_bf16 | amp_fp16 | pure_fp16)
Run it with and without ONEDNN_MAX_CPU_ISA=AVX2 (which keeps oneDNN off its avx512_bf16/AMX kernels, so torch's
reference kernels run, as on a CPU without them). One warm-up step, then STEPS timed steps (fwd, bwd, SGD)."""
import os, sys, time
import torch, torchvision

model_name, size, batch, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
steps = int(os.environ.get("STEPS", "3"))
torch.manual_seed(0)
model = torchvision.models.get_model(model_name, num_classes=10)
x = torch.randn(batch, 3, size, size)
y = torch.randint(0, 10, (batch,))
half = torch.float16 if mode.endswith("fp16") else torch.bfloat16
if mode.startswith("pure"):
    model, x = model.to(half), x.to(half)
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def step():
    with torch.autocast("cpu", dtype=half, enabled=mode.startswith("amp")):
        loss = torch.nn.functional.cross_entropy(model(x).float(), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
t = time.perf_counter()
for _ in range(steps):
    step()
dt = (time.perf_counter() - t) / steps
print(f"{model_name},{size},{batch},{mode},{os.environ.get('ONEDNN_MAX_CPU_ISA', 'native')},"
      f"{torch.get_num_threads()},{dt * 1000:.1f},{batch / dt:.2f}")
