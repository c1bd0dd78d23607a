"""calibrate's harness for its concurrent one-process runs: the unchanged script, meeting N-1 others before
every optimizer step, as a job's ranks do.

    python common/bench/lockstep.py HOST:PORT:N WAITS.json pytorch_SingleGPU.py --device cpu ...
    torchrun --nproc_per_node 1 common/bench/lockstep.py HOST:PORT:N WAITS.json pytorch_DDP.py ...

calibrate's one-process runs stand for a job's ranks, and a job's ranks step together (their gradient
collectives end at once), so a memory-bound optimizer step meets the other rank's optimizer step, not its
forward. Unsynchronized, two 1-thread SGD steps over resnet18 on 2 cores took 6.6 and 8.1 ms; in lockstep
10.3 and 10.3. The meeting is a TCPStore's (no process group: each run is a world of one).

The script runs as its launcher would run it (runpy, as __main__); the harness wraps the step its TrainHooks
hand to the loop (common/train.py fit), so the loop itself knows nothing of it. Each meeting's wait falls
inside the loop's optimizer phase: WAITS.json lists every step's wait in seconds and whether this run
arrived last (its wait was the meeting's own cost, nobody's skew), and calibrate takes the timed window's
waits (the row's last timed_steps) off step_optimizer_ms.
"""
import datetime
import json
import os
import runpy
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Lockstep:
    """N separate processes meeting before each optimizer step at a running TCPStore (HOST:PORT:N)."""

    def __init__(self, spec: str, timeout_s: float = 300.0):
        import torch.distributed as dist

        host, port, n = spec.rsplit(":", 2)
        self.n, self.k = int(n), 0
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def wait(self) -> bool:
        """True when this run arrived last."""
        k, self.k = self.k, self.k + 1
        last = self.store.add(f"arrived{k}", 1) == self.n
        if last:
            self.store.set(f"go{k}", "1")
        self.store.wait([f"go{k}"])
        return last


def meeting(step, lockstep: Lockstep, waits: list):
    """step() after the others arrived; each wait and whether this run came last appended to `waits`."""

    def met(*args, **kwargs):
        t = time.perf_counter()
        last = lockstep.wait()
        waits.append((time.perf_counter() - t, last))
        return step(*args, **kwargs)

    return met


def in_step(fit, lockstep: Lockstep, waits: list):
    """fit() with the step the script hands it meeting the others first: the optimizer's step, or the step of
    an engine that steps inside backward (accelerate's DeepSpeed: TrainHooks.step_inside_backward), whose
    loop step is then no step at all."""

    def fit_in_lockstep(cfg, model, train_loader, test_loader, hooks, checkpointer=None):
        owner = hooks.step_inside_backward
        if owner is not None:
            owner.step = meeting(owner.step, lockstep, waits)
        else:
            hooks.step = meeting(hooks.step, lockstep, waits)
        return fit(cfg, model, train_loader, test_loader, hooks, checkpointer)

    return fit_in_lockstep


def run(spec: str, out: str, script: str, args: list[str]) -> None:
    sys.path[0] = ROOT  # the script's folder, as `python SCRIPT` would have it (not common/bench/: its names)
    import common
    import common.train

    lockstep, waits, fit = Lockstep(spec), [], common.train.fit

    common.fit = in_step(fit, lockstep, waits)  # the scripts import fit from common when runpy runs them
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(out, "w") as fh:
            json.dump({"wait_s": [w for w, _ in waits], "last": [last for _, last in waits]}, fh)


def in_lockstep(cmd: list[str], script: str, spec: str, out: str) -> list[str]:
    """A run's command (python, or a launcher, then the script and its flags) with the harness before the script."""
    i = cmd.index(script)
    return [*cmd[:i], os.path.join(ROOT, "common", "bench", "lockstep.py"), spec, out, *cmd[i:]]


def window_waits(path: str, timed_steps: int) -> tuple[float, float | None]:
    """(the mean wait per step of a run's timed window, the mean of those it arrived last at, or None): the
    window is the run's last timed_steps optimizer steps (calibrate's runs train one epoch)."""
    with open(path) as fh:
        got = json.load(fh)
    pairs = list(zip(got["wait_s"], got["last"]))[-timed_steps:] if timed_steps else []
    if not pairs:
        return 0.0, None
    lasts = [w for w, last in pairs if last]
    return sum(w for w, _ in pairs) / len(pairs), (sum(lasts) / len(lasts) if lasts else None)


def arguments(argv: list[str]) -> tuple[str, str, str, list[str]]:
    """(spec, waits file, script, the script's arguments) of the harness's command line. The deepspeed launcher
    puts --local_rank=N straight after the script it starts (deepspeed/launcher/launch.py), which is the
    harness here: it is the training script's, and goes right after that script, where the launcher meant it."""
    args, passed = list(argv), []
    while args and args[0].startswith("--local_rank"):
        passed.append(args.pop(0))
    spec, out, script, *rest = args
    return spec, out, script, passed + rest


if __name__ == "__main__":
    os.chdir(ROOT)
    run(*arguments(sys.argv[1:]))
