"""The timed window and what it drives: instruments open after the warm-up steps, pause around
epoch-end work (checkpoint saves), and the GPU probes reset and keep their peaks accordingly."""
import types
from contextlib import nullcontext

import pytest
import torch
import torch.nn as nn

from common.config import TrainConfig
from common.measure import Instrument
from common.measure import probes as probes_mod
from common.train import TimedWindow, TrainHooks, fit


class Recorder(Instrument):
    def __init__(self):
        self.events, self.paused, self.started = [], False, False

    def start(self):
        self.events.append("start")
        self.started = True

    def pause(self):
        self.events.append("pause")
        self.paused = True

    def resume(self):
        self.events.append("resume")
        self.paused = False

    def step(self):
        self.events.append("step")

    def stop(self):
        self.events.append("stop")

    def row(self):
        return {"recorded": len(self.events)}


def three_steps_and_one(w: TimedWindow) -> None:
    """An epoch of 3 steps, then the first step of the next."""
    w.epoch_start(0)
    for s in (1, 2, 3):
        w.after_step(s)
    w.epoch_end()
    w.epoch_start(3)
    w.after_step(4)


def test_window_opens_after_the_warm_up_and_pauses_at_epoch_ends():
    rec = Recorder()
    w = TimedWindow(opens_at=2, device=torch.device("cpu"), instruments=[rec])
    three_steps_and_one(w)
    w.epoch_end()
    assert rec.events == ["start", "step", "pause", "resume", "step", "pause"]
    assert w.steps == 2 and w.close() == {"recorded": 7, "notes": None} and rec.events[-1] == "stop"


def test_the_garbage_left_is_collected_outside_the_window(monkeypatch):
    """A full collection the set-up left pending (DDP+ZeRO: 345,000 objects, 155 ms) runs before the window
    opens and before it resumes (the window not running), never between its steps, and the ranks meet
    after it; after the profiler, its trace's collection and the ranks' meeting open the window (one pass
    over the heap, 0.17 s a rank in a training process, not two)."""
    rec = Recorder()
    prof = Recorder()
    prof.outside_window, prof.done = 1, 0
    prof.step = lambda: setattr(prof, "done", prof.done + 1)
    monkeypatch.setattr("common.train.gc.collect",
                        lambda: rec.events.append("gc" if not w.running else "gc in the window"))
    monkeypatch.setattr("common.train.barrier", lambda: rec.events.append("barrier"))
    w = TimedWindow(opens_at=1, device=torch.device("cpu"), instruments=[rec, prof], total_steps=10)
    three_steps_and_one(w)
    # the ranks meet after each collection: its time differs between them
    assert rec.events == ["gc", "barrier", "start", "step", "pause", "gc", "barrier", "resume", "step"]


def test_window_that_never_opens_reports_nothing():
    rec = Recorder()
    w = TimedWindow(opens_at=5, device=torch.device("cpu"), instruments=[rec])
    w.epoch_start(0)
    w.after_step(1)
    w.epoch_end()
    assert w.close() == {"recorded": 0, "notes": None} and rec.events == []


class FakeClock:
    """Stands for the `time` module of the code under test (install() puts it there): its perf_counter reads
    a clock that only the test moves, with sleep(). A duration is then the one the test gave, on a slow or a
    loaded host alike, and what the code computes from it can be asserted exactly."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.t += seconds

    def install(self, monkeypatch, *modules) -> "FakeClock":
        for module in modules:
            monkeypatch.setattr(module, "time", self)
        return self


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 10)

    def forward(self, x):
        return self.fc(x.flatten(1))


class SpyCheckpointer:
    """Records whether the instruments were paused while the epoch's state was saved."""

    def __init__(self, recorder):
        self.recorder, self.saves = recorder, []

    def save(self, epoch, meta):
        self.saves.append((epoch, self.recorder.paused, meta["window_steps"]))


def fit_two_epochs(monkeypatch, rec, evaluations, probe_devices=None):
    """fit() over 2 epochs of 4 steps, 3 warm-up steps, with `rec` as the only instrument (None: as patched)."""
    if rec is not None:
        monkeypatch.setattr("common.train.build_instruments", lambda cfg, model, hooks, m, *_: [rec])
    cfg = TrainConfig(epochs=2, timing_warmup_steps=3, log_every=0, batch_size=4, loader_probe_batches=0)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 3, 2, 2), torch.randint(0, 10, (4,))) for _ in range(4)]

    def step():
        opt.step()
        opt.zero_grad()

    hooks = TrainHooks(lambda loss: loss.backward(), step, torch.device("cpu"), ctx=nullcontext(),
                       evaluate=lambda *a, **k: evaluations.append(1) or (0.5, 10), probe_devices=probe_devices)
    ckpt = SpyCheckpointer(rec or Recorder())
    return fit(cfg, model, batches, None, hooks, ckpt), ckpt


def test_fit_times_after_the_warm_up_and_saves_outside_the_window(monkeypatch):
    rec, evaluations = Recorder(), []
    m, ckpt = fit_two_epochs(monkeypatch, rec, evaluations)
    assert m.steps == 8 and m.timed_steps == 5  # warm-up steps 1..3 are outside the window
    assert ckpt.saves == [(1, True, 1), (2, True, 5)]  # saved while paused, window counts carried
    assert rec.events.count("start") == 1 and rec.events.count("step") == 5 and rec.events[-1] == "stop"
    assert m.throughput_img_s > 0 and m.extra["recorded"] == len(rec.events)
    assert len(evaluations) == 1 and m.test_accuracy == 0.5  # evaluated once, after training


def test_the_clock_waits_for_every_device_the_process_drives(monkeypatch):
    """Model parallelism: the second half's optimizer step can still run on cuda:1 when cuda:0 is done. The
    epoch's clock and the window wait for both, not for the first alone."""
    import common.distributed as distributed

    waited = []
    monkeypatch.setattr("common.train.synchronize", lambda d: waited.append(d))
    two = [torch.device("cuda", 0), torch.device("cuda", 1)]
    fit_two_epochs(monkeypatch, Recorder(), [], probe_devices=two)
    assert waited and all(d == two for d in waited)
    synced = []
    monkeypatch.setattr(distributed.torch.cuda, "synchronize", lambda d: synced.append(d))
    distributed.synchronize(two)
    distributed.synchronize(torch.device("cpu"))
    assert synced == two


class Profiler(Recorder):
    """Needs 2 steps of its own before the window, as CommRecorder with --comm-steps 2."""
    outside_window = 2

    def step(self):
        super().step()
        self.done += 1


def test_profiled_steps_precede_the_window_and_no_instrument_sees_them(monkeypatch):
    """Warm-up steps 1-3, the profiler from step 4; epoch 1 ends after one profiled step (stopped
    early), and the window opens at epoch 2: its 4 steps, all of them unprofiled."""
    rec, prof = Recorder(), Profiler()
    monkeypatch.setattr("common.train.build_instruments", lambda cfg, model, hooks, m, *_: [rec, prof])
    m, ckpt = fit_two_epochs(monkeypatch, None, [])
    assert prof.events[:3] == ["start", "step", "stop"] and prof.events.count("step") == 1
    assert m.timed_steps == 4 and rec.events.count("step") == 4 and rec.events[0] == "start"
    assert [s[2] for s in ckpt.saves] == [0, 4]


def test_window_opens_after_the_profiled_steps():
    rec, prof = Recorder(), Profiler()
    w = TimedWindow(opens_at=1, device=torch.device("cpu"), instruments=[rec, prof], total_steps=10)
    w.epoch_start(0)
    w.after_step(1)  # warm-up
    assert prof.events == ["start"] and rec.events == []
    w.after_step(2)
    w.after_step(3)  # the profiler's 2 steps, then the window opens
    assert prof.events[-1] == "stop" and rec.events == ["start"] and w.steps == 0
    w.after_step(4)
    assert w.steps == 1 and rec.events == ["start", "step"] and prof.events.count("step") == 2


def test_too_few_steps_left_profile_inside_the_window():
    rec, prof = Recorder(), Profiler()
    w = TimedWindow(opens_at=1, device=torch.device("cpu"), instruments=[rec, prof], total_steps=3)
    w.epoch_start(0)
    w.after_step(1)
    assert rec.events == ["start"] == prof.events  # 2 steps left: both are the window's
    w.after_step(2)
    w.after_step(3)
    assert w.steps == 2 and prof.events.count("step") == 2


def test_time_to_target_is_the_training_time_at_the_first_epoch_that_reaches_it(monkeypatch):
    monkeypatch.setattr("common.train.build_instruments", lambda cfg, model, hooks, m, *_: [])
    cfg = TrainConfig(epochs=3, timing_warmup_steps=0, log_every=0, batch_size=4, loader_probe_batches=0,
                      target_accuracy=0.6)
    model = TinyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    accuracies = iter([0.5, 0.7, 0.9])

    def step():
        opt.step()
        opt.zero_grad()

    hooks = TrainHooks(lambda loss: loss.backward(), step, torch.device("cpu"),
                       evaluate=lambda *a, **k: (next(accuracies), 10))
    times = []
    m = fit(cfg, model, [(torch.randn(4, 12), torch.randint(0, 10, (4,)))] * 2, None, hooks,
            types.SimpleNamespace(save=lambda epoch, meta: times.append(meta["train_time_s"])))
    assert m.time_to_target_s == pytest.approx(times[1])  # epoch 2 reached 0.7 >= 0.6
    assert m.test_accuracy == 0.9  # the last epoch's evaluation is the final one (no extra pass)


class FakeAllocator:
    """torch.cuda's peak counters for one fake device."""

    def __init__(self):
        self.current = self.peak = 0

    def alloc(self, n):
        self.current += n
        self.peak = max(self.peak, self.current)

    def free(self, n):
        self.current -= n


@pytest.fixture
def fake_gpu(monkeypatch):
    a = FakeAllocator()

    def reset(device):
        a.peak = a.current

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: a.peak)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d: a.peak)
    monkeypatch.setattr(probes_mod, "nvml_handle", lambda d: (None, None))
    return a


def test_probe_peaks_cover_the_window_only(fake_gpu):
    gib = probes_mod.GIB
    p = probes_mod.Probes([torch.device("cuda", 0)], torch.device("cpu"))
    fake_gpu.alloc(5 * gib)  # warm-up: cuDNN autotuning workspace
    fake_gpu.free(5 * gib)
    p.start()
    fake_gpu.alloc(2 * gib)  # training
    fake_gpu.free(2 * gib)
    p.pause()
    fake_gpu.alloc(7 * gib)  # epoch-end checkpoint save
    fake_gpu.free(7 * gib)
    p.resume()
    fake_gpu.alloc(3 * gib)
    fake_gpu.free(3 * gib)
    p.stop()
    assert p.row()["peak_allocated_gib"] == 3.0


def test_a_profiler_an_epoch_end_cut_before_its_first_step_starts_again():
    """The window's opening step ends the epoch: the profiler started there ran no step, so it
    profiles the next epoch's first steps rather than leaving the comm columns empty."""
    rec, prof = Recorder(), Profiler()
    w = TimedWindow(opens_at=2, device=torch.device("cpu"), instruments=[rec, prof], total_steps=8)
    w.epoch_start(0)
    w.after_step(1)
    w.after_step(2)  # warm-up done at the epoch's last step: the profiler starts
    w.epoch_end()
    assert prof.done == 0 and prof in w.before and rec.events == []
    w.epoch_start(2)
    w.after_step(3)
    w.after_step(4)
    assert prof.done == 2 and rec.events == ["start"]


def test_the_model_state_walk_runs_in_a_profiled_step_when_there_is_no_warm_up():
    class Armed(Recorder):
        def prelude(self):
            self.events.append("prelude")

    rec, prof = Armed(), Profiler()
    w = TimedWindow(opens_at=0, device=torch.device("cpu"), instruments=[rec, prof], total_steps=8)
    w.epoch_start(0)
    assert rec.events == ["prelude"]  # armed with the profiler, before any timed step


def test_exposed_communication_is_empty_where_nothing_profiles_it(monkeypatch):
    """DataParallel and model parallelism drive several GPUs from one process: their copies between GPUs are
    on the step's path but never profiled as collectives, so step_comm_exposed_ms is empty there, not 0; a
    single device has nothing to expose (0); a distributed run reads its profiler, or nothing without one."""
    from common import train
    from common.measure.stepparts import StepParts
    from common.train import exposed_comm_source

    gpus = [torch.device("cuda", 0), torch.device("cuda", 1)]
    for name in ("Probes", "Energy", "HostShare", "Flops", "ModelState", "StepTimes"):  # CUDA's own, faked
        monkeypatch.setattr(train, name, lambda *a, **kw: Instrument())
    hooks = train.TrainHooks(None, None, torch.device("cuda", 0), probe_devices=gpus, optimizer=None)
    (parts,) = [i for i in train.build_instruments(TrainConfig(), nn.Linear(1, 1), hooks, train.Metrics())
                if isinstance(i, StepParts)]
    assert parts.comm.exposed_ms_per_step() is None  # model parallelism: no process group, two GPUs
    assert exposed_comm_source([], False, gpus).exposed_ms_per_step() is None
    assert exposed_comm_source([], False, [torch.device("cuda", 0)]) is None
    assert exposed_comm_source([], True, [torch.device("cuda", 0)]).exposed_ms_per_step() is None
    assert exposed_comm_source(["recorder"], True, gpus) == "recorder"
