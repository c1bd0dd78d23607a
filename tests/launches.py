"""One launch, many checks: the end-to-end runs the tests share.

Each training script x precision it accepts (from the registry) and a few named variants run once per
pytest session, under their real launcher, on the first test that asks for them; every test that checks
a property of such a run (its row, its model state, its bytes per step, its checkpoint loading into a
bare model, inference on that checkpoint) reads the same launch. A launch starts 2-3 processes that
import torch, torchvision and DeepSpeed (10-20 s on 2 cores): checking six properties of one run used
to cost six of them. What needs a run of its own keeps launching it: a kill and a resume, a restart, bad
input, another world size, settings no shared run has.

    @pytest.mark.launches("pytorch_DDP-fp32")
    def test_x(runs):
        (r,) = runs   # the marker's launches: run now, or the session's earlier results
        r.row["comm_bytes_per_step"]

Disk: a run's resume checkpoints (twice the model) and DeepSpeed's final shards are deleted once it
ends; its model_final.pt (~43 MB for resnet18 in fp32, 15 such runs: ~0.7 GB) stays for the tests that
load it, until the session ends.

Two at a time: a test that reads shared launches says which with `@pytest.mark.launches(...)` (a name of
CASES, or a template filled from the test's parameters: "{name}", "{entry.name}-{precision}"), and reads
them from the `runs` fixture, in the marker's order (a module-scoped fixture calls `launched(name)`). While such
a test's launch runs, the next launch of the tests that follow it starts beside it: a `python` run keeps one
core busy (OMP_NUM_THREADS=1, and importing torch is single-threaded), and torchrun's own start and exit
leave the second core idle, about 18% of a 2-rank launch. The checks on shared rows are structural (counts,
bytes, sums that tile the window), not timings.

Beside the other tests: a test that uses about one core and checks no timing runs with one launch of the
tests ahead beside it (`beside(item)`): every fast-tier test (in-process, one core; none times real sleeps,
CONTRIBUTING.md), and the slow ones marked `@pytest.mark.beside` (one process
at a time, or a launcher's waits: a calibration, the doctor, a compile). Any other test first waits for the
launches in flight and starts none (conftest.py), so that its own launches have the cores to themselves. The
look-ahead starts from the session's first test and looks past every test to the next launch not yet run.
Without this the suite left a core idle for about a fifth of its core-seconds on a 2-core machine.
A launch is built when it is planned, in pytest's thread, from the session's environment and launchers as
they were when the session began: a fast test that monkeypatches the environment, `sys.executable`,
`subprocess` or the launcher lookup while a launch starts in a pool thread changes nothing of it.
"""
from __future__ import annotations

import shutil
import subprocess
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from helpers import ROOT, clean_env, command, half_size, hold_port, launchers, release_port, rows, tiny_args

from common.registry import BY_FILE, SCRIPTS

DS_JSONS = ["config/zero_stage1_config.json", "config/zero_stage2_config.json", "config/zero_stage3_config.json"]
# the DeepSpeed scripts: every shipped JSON through each, every precision on some JSON
DS_CASES = {"pytorch_DeepSpeed.py": {"fp16": DS_JSONS[0], "bf16": DS_JSONS[1], "fp32": DS_JSONS[2]},
            "accelerate_DeepSpeed.py": {"bf16": DS_JSONS[0], "fp16": DS_JSONS[1], "fp32": DS_JSONS[2]}}
# the fp32 runs are also test_equivalence's: every rank sees the pixels one process sees (no random
# augmentation) and BatchNorm normalizes with its running statistics (eval mode), so the loss of a batch
# does not depend on how it is split over ranks; no learning-rate warm-up. BatchNorm in train mode and
# augmentation run in every half-precision case and in the runs of the other tests.
EQUAL = {"augment": False, "freeze_bn": True, "warmup_steps": 0}
# ... and they run at 3 ranks (the pipeline at 2: one stage per rank), 4 images each: 3 divides neither
# resnet18's parameter counts nor the 37 test samples, so padded and uneven shards are what the model-state,
# volume and equivalence checks see (4 steps of 12 images: the same window as TINY's 4 of 16)
AT_3 = {"batch_size": 12, "train_samples": 48}
# the half-precision runs: the smallest torchvision classifier the checks allow. Where oneDNN has no native
# fp16/bf16 kernels (fp16 on most CPUs, bf16 on those without avx512_bf16) torch's reference kernels run:
# a resnet18 step of 8 images at 16 px takes 1.6 s there, shufflenet_v2_x0_5's 0.09 s
HALF_MODEL = "shufflenet_v2_x0_5"
# the vision transformer of the TP runs: at 32 px (16 where half kernels are emulated: helpers.half_size) 4
# patches, 86M parameters; TINY's 4 steps of 16
VIT = {"model": "vit_b_16"}
# ... compared with one process in 2 steps of 16 (a tp 2 x dp 2 step of its 86M parameters on 4 processes
# over 2 cores takes ~5 s)
VIT_STEPS = {"train_samples": 32}
# 86M parameters: no epoch checkpoint (0.7 GB with the momentum) where no test reads one
VIT_EQUAL = {**EQUAL, **VIT, **VIT_STEPS, "epoch_checkpoints": False}
# ... in half precision 4 steps of 4: where the half kernels are emulated, a step of 16 would take seconds
VIT_HALF = {"batch_size": 4, "train_samples": 16}
# ... and in fp16 24 steps of 16: the loss scalers start at 2^16 (torch.amp.GradScaler's init_scale; the JSONs'
# initial_scale_power 16, hysteresis 2) and skip their first steps for overflow, 4 at 32 px and 8 at 16 px
# (helpers.half_size) for GradScaler, one more for DeepSpeed's hysteresis: 4 steps would update nothing
FP16_STEPS = {"train_samples": 384}
# flags some cases add, so that the option's path runs somewhere
EXTRA = {("pytorch_auto_mixed_precision.py", "fp16"): {"clip_grad_norm": 1.0},
         ("pytorch_half_precision.py", "bf16"): {"bn_fp32": True, "loss_scale": 128}}


def deepspeed_fp16_here() -> bool:
    """DeepSpeed's CPU accelerator rule (deepspeed/accelerator/cpu_accelerator.py is_fp16_supported)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


@dataclass(frozen=True)
class Launch:
    """One run: `script` (the row's script) started by `launcher` on `nproc` processes with helpers.TINY's
    flags and `over` on top. `twin`: the command of a CPU twin in tests/twins/ that runs the script's own
    main() instead (its path, and its arguments before the flags)."""
    script: str
    precision: str = "fp32"
    over: tuple = ()  # (flag, value) pairs over TINY
    nproc: int = 1
    launcher: str = "python"
    env: tuple = ()
    twin: tuple = ()

    def flags(self) -> dict:
        return {"precision": self.precision, **half_size(self.precision), **dict(self.over)}


def script_case(file: str, precision: str) -> Launch:
    """test_scripts' run of a script at a precision: 2 ranks under torchrun for a distributed script
    (the accelerate ones too: `accelerate launch` runs the same torchrun underneath), the DeepSpeed
    JSON of DS_CASES, and DeepSpeed fp16 through its twin where DeepSpeed refuses fp16 on this CPU
    (test_deepspeed_refuses_a_dtype_its_accelerator_lacks), so the engine's fp16 path still runs."""
    s = BY_FILE[file]
    fp32 = precision == "fp32"
    half = {"model": HALF_MODEL, **(FP16_STEPS if precision == "fp16" else {})}
    over = {**({**EQUAL, **AT_3} if fp32 else half), **EXTRA.get((file, precision), {})}
    if "model" in s.preset_args:  # a script for one family (pytorch_TP.py: a ViT, heads split over 2 ranks)
        over = {**({**EQUAL, **VIT_STEPS} if fp32 else VIT_HALF), **VIT}
    if file in DS_CASES:
        over["deepspeed_config"] = DS_CASES[file][precision]
    twin = ("tests/twins/deepspeed_fp16_on_cpu.py", file) if s.deepspeed_config and precision == "fp16" \
        and not deepspeed_fp16_here() else ()
    nproc = 1 if not s.distributed else \
        3 if fp32 and s.max_processes is None and "model" not in s.preset_args and not s.needs_cuda else 2
    return Launch(file, precision, tuple(sorted(over.items())), nproc=nproc,
                  launcher="torchrun" if s.distributed else "python", twin=twin)


def precisions_run(s) -> tuple:
    """The precisions test_scripts runs a script at on this CPU: a script that needs CUDA refuses --device cpu
    before its precision matters, so once (its precisions train in the GPU tier, on CPU through
    accelerate_FSDP-twin)."""
    return tuple(s.precisions[:1] if s.needs_cuda else s.precisions)


CASES: dict[str, Launch] = {f"{s.name}-{p}": script_case(s.file, p) for s in SCRIPTS for p in precisions_run(s)}
CASES.update({
    # the deepspeed launcher itself, on the script's default JSON (ZeRO-2)
    "pytorch_DeepSpeed-launcher": Launch("pytorch_DeepSpeed.py", nproc=2, launcher="deepspeed"),
    # accelerate's own FSDP2 path forced on over gloo (accelerate_FSDP.py itself refuses CPU)
    "accelerate_FSDP-twin-fp32": Launch("accelerate_FSDP.py", "fp32", (("clip_grad_norm", 1.0),), 2, "torchrun",
                                        twin=("tests/twins/accelerate_fsdp_on_cpu.py",)),
    # a vision transformer, one FSDP unit per EncoderBlock (test_blocks): vit_b_16 at 32 px is 4 patches;
    # 86M parameters, so no epoch checkpoint (0.7 GB with the momentum) and 2 steps (warm-up, one timed)
    "pytorch_FSDP-vit_b_16": Launch("pytorch_FSDP.py", "fp32", (
        ("epoch_checkpoints", False), ("image_size", 32), ("loader_probe_batches", 0), ("model", "vit_b_16"),
        ("train_samples", 32)), 2, "torchrun"),
    # test_tp: the same steps in one process, and tp 2 x FSDP over dp 2 on 4 ranks
    "pytorch_SingleGPU-vit_b_16": Launch("pytorch_SingleGPU.py", "fp32", tuple(sorted(VIT_EQUAL.items()))),
    # test_blocks: vit_b_16 cut between its EncoderBlocks (2 pipeline ranks; the two halves in one process)
    "pytorch_PP-vit_b_16": Launch("pytorch_PP.py", "fp32", tuple(sorted(VIT_EQUAL.items())), 2, "torchrun"),
    "pytorch_MP-vit_b_16": Launch("pytorch_MP.py", "fp32", tuple(sorted(VIT_EQUAL.items()))),
    "pytorch_TP-fp32-dp2": Launch("pytorch_TP.py", "fp32", tuple(sorted({**VIT_EQUAL, "tp": 2}.items())), 4,
                                  "torchrun"),
    # the half-precision twin trains HALF_MODEL, as every half case: resnet18 on reference bf16 kernels (AVX2-only
    # CPUs) takes seconds a step
    "accelerate_FSDP-twin-bf16": Launch("accelerate_FSDP.py", "bf16", (("clip_grad_norm", 1.0), ("model", HALF_MODEL)),
                                        2, "torchrun", twin=("tests/twins/accelerate_fsdp_on_cpu.py",)),
})


def variant(base: str, more: dict, nproc: int | None = None, twin: tuple = ()) -> Launch:
    """CASES[base] with `more` over its flags, and another process count or twin where given."""
    case = CASES[base]
    return replace(case, over=tuple(sorted({**dict(case.over), **more}.items())), nproc=nproc or case.nproc,
                   twin=twin or case.twin)


CASES.update({name: variant(base, more, nproc) for name, base, more, nproc in [
    # pytorch_DDP-fp32 again with the harness's metric all-reduces in every step (DDP's calls per step do not
    # depend on the world size: 2 ranks, one import fewer than 3)
    ("pytorch_DDP-fp32-log1", "pytorch_DDP-fp32", {"log_every": 1}, 2),
    # 2 ranks x 2 accumulated micro-batches of 3 (test_equivalence)
    ("pytorch_DDP-fp32-accum2", "pytorch_DDP-fp32", {"grad_accum": 2}, 2),
    # FSDP's gathers per micro-batch, its one reduce-scatter per step (test_comm)
    ("pytorch_FSDP-fp32-accum2", "pytorch_FSDP-fp32", {"grad_accum": 2, "epoch_checkpoints": False}, 2),
    # the other schedule and an explicit split (test_equivalence)
    ("pytorch_PP-fp32-1f1b", "pytorch_PP-fp32", {"schedule": "1f1b", "split": "2,2"}, None),
]})
# the flags that need CUDA, on CPU through tests/twins/cuda_flags_on_cpu.py: FSDP's and DeepSpeed's offload (its
# ZeRO-3 JSON: parameters and optimizer state in host memory) as their fp32 runs, at 2 ranks of 6 (one process
# fewer on 2 cores; the uneven shards are the 3-rank runs'), the steps of one
# process (test_equivalence); SyncBatchNorm with BatchNorm in train mode, one step of 3 x 4 beside one process's
# step of 12 (its gradients through BatchNorm are float32-exact after one step; later ones amplify rounding)
CUDA_TWIN = "tests/twins/cuda_flags_on_cpu.py"
BN_TRAIN = {**EQUAL, "freeze_bn": False, "batch_size": 12, "train_samples": 12}
CASES.update({name: variant(base, more, nproc, (CUDA_TWIN, CASES[base].script)) for name, base, more, nproc in [
    ("pytorch_FSDP-cpu-offload-twin", "pytorch_FSDP-fp32", {"cpu_offload": True}, 2),
    ("pytorch_DeepSpeed-offload-twin", "pytorch_DeepSpeed-fp32", {"offload": True}, 2),
    ("pytorch_DDP-sync-bn-twin", "pytorch_DDP-fp32", {**BN_TRAIN, "sync_bn": True}, 3),
]})
CASES["pytorch_SingleGPU-bn-train"] = Launch("pytorch_SingleGPU.py", "fp32", tuple(sorted(BN_TRAIN.items())))
# test_reliability's uninterrupted reference for a run whose rank 1 is killed and restarted: TINY's flags, 3 epochs
CASES["pytorch_DDP-fp32-3epochs"] = Launch("pytorch_DDP.py", "fp32", (("epochs", 3),), 2, "torchrun")
# test_memory's model state at 3 ranks (3 divides none of resnet18's parameter counts: padded, uneven shards)
# with AdamW's two states, for what test_scripts' fp32 runs do not cover: DDP+ZeRO with AdamW, FSDP's
# shard-grad-op, DeepSpeed's ZeRO-2 (torchrun: the deepspeed launcher runs in pytorch_DeepSpeed-launcher)
MODEL_STATE_AT_3 = {"batch_size": 12, "train_samples": 24, "test_samples": 6, "loader_probe_batches": 0,
                    "epoch_checkpoints": False, "optimizer": "adamw"}
CASES.update({f"{script[:-3]}-{name}-at3": Launch(script, "fp32", tuple(sorted({**MODEL_STATE_AT_3, **more}.items())),
                                                  3, "torchrun")
              for script, name, more in [
    ("pytorch_DDP_ZeRO.py", "adamw", {}),
    ("pytorch_FSDP.py", "shard-grad-op-adamw", {"sharding": "shard-grad-op"}),
    ("pytorch_DeepSpeed.py", "zero2-adamw", {"deepspeed_config": "config/zero_stage2_config.json"}),
]})


@dataclass
class Result:
    launch: Launch
    folder: Path
    proc: subprocess.CompletedProcess
    resume_saved: bool = False  # the run wrote its epoch checkpoint (deleted since)
    rows: list = field(default_factory=list)

    @property
    def row(self) -> dict:
        """The run's one row (a test reading it asserts there is exactly one)."""
        assert len(self.rows) == 1, (len(self.rows), self.proc.stderr[-3000:])
        return self.rows[0]

    def final(self) -> Path:
        return self.folder / "ckpt" / self.launch.script[:-3] / "model_final.pt"


IN_FLIGHT = 2  # launches running at once: two cores
POPEN = subprocess.Popen  # as imported: test_time's calibrate tests replace subprocess.Popen while they run


def beside(item) -> bool:
    """A test a prefetched launch may run beside: the fast tier's (in-process, one core) and the slow ones
    marked `beside`."""
    return item.get_closest_marker("slow") is None or item.get_closest_marker("beside") is not None


def limit_for(item) -> int:
    """The launches that may run while `item` runs: 1 beside a test marked so, even one that reads shared
    launches first (its own processes come after); IN_FLIGHT while a test reads them; else 0."""
    if beside(item):
        return 1
    return IN_FLIGHT if item.get_closest_marker("launches") else 0


class SharedLaunches:
    def __init__(self, root: Path):
        self.root, self.done = root, {}
        self.futures: dict[str, Future] = {}
        self.pool = ThreadPoolExecutor(IN_FLIGHT, thread_name_prefix="launch")
        self.lock = threading.RLock()  # conftest.py's clean-up holds it around running_pids()
        self.plan = threading.RLock()  # futures and the look-ahead: pytest's thread and the launches' callbacks
        self.pids: set[int] = set()  # launchers running now: conftest.py leaves them to the tests that read them
        self.needs: list[list[str]] = []  # per collected test, in order: the launches its marker names
        self.index: dict[str, int] = {}  # a collected test's node id -> its place in `needs`
        self.limit = IN_FLIGHT  # launches in flight the running test allows (conftest.py sets it per test)
        self.env, self.found = clean_env(), launchers()  # the session's, before any test's monkeypatch

    def __call__(self, name: str) -> Result:
        if name not in self.done:
            with self.plan:
                self._submit(name)
                self._look_ahead()
                future = self.futures[name]
            result = future.result()
            with self.plan:
                self.futures.pop(name, None)
                self.done[name] = result
        return self.done[name]

    def allow(self, limit: int) -> None:
        """The running test allows `limit` launches in flight: IN_FLIGHT while it reads shared launches, 1
        beside a test that uses one core, 0 (and wait for those in flight) before any other."""
        with self.plan:
            self.limit = limit
            self._look_ahead()
        if limit == 0:
            self.drain()

    def _submit(self, name: str) -> None:
        if name not in self.futures and name not in self.done:
            case = CASES[name]
            folder = self.root / name
            folder.mkdir(parents=True)
            args = tiny_args(folder, **case.flags())
            script, args = (case.twin[0], list(case.twin[1:]) + args) if case.twin else (case.script, args)
            port = hold_port() if case.launcher != "python" else None
            cmd = command(script, args, case.nproc, case.launcher, port, found=self.found)
            self.futures[name] = self.pool.submit(self._launch, name, case, folder, cmd, port)
            self.futures[name].add_done_callback(lambda _: self._top_up())

    def _top_up(self) -> None:
        with self.plan:
            self._look_ahead()

    def _look_ahead(self) -> None:
        """Top up to the running test's limit with the launches it and the tests after it need. It looks past
        every test: one that allows none waits for those in flight when it starts, and the work is the same
        whenever it runs, so a launch started early costs nothing and may fill a core that would idle."""
        for i in range(self.index.get(RUNNING, len(self.needs)), len(self.needs)):
            for name in self.needs[i]:
                if sum(not f.done() for f in self.futures.values()) >= self.limit:
                    return
                self._submit(name)

    def running_pids(self) -> list[int]:
        """The launchers running now (their threads add and remove them)."""
        with self.lock:
            return list(self.pids)

    def drain(self) -> None:
        """Wait for the launches in flight (their results are kept for the tests that read them)."""
        with self.plan:
            pending = list(self.futures.values())
        for future in pending:
            future.exception()

    def _launch(self, name: str, case: Launch, folder: Path, cmd: list[str], port: int | None) -> Result:
        """In the pool's thread: start the command built in pytest's, wait, read the row."""
        env = {**self.env, **dict(case.env)}
        with self.lock:  # started and recorded at once, for conftest.py's clean-up after a failed test to spare
            proc = POPEN(cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            self.pids.add(proc.pid)
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        finally:
            with self.lock:
                self.pids.discard(proc.pid)
            release_port(port)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        resume = folder / "ckpt" / case.script[:-3] / "resume"
        saved = resume.is_dir()
        shutil.rmtree(resume, ignore_errors=True)
        shutil.rmtree(resume.parent / "ds_checkpoint", ignore_errors=True)  # DeepSpeed's final shards, read already
        return Result(case, folder, done, saved, rows(folder / "summary.csv"))

    def close(self) -> None:
        self.allow(0)
        self.pool.shutdown(wait=True)
        shutil.rmtree(self.root, ignore_errors=True)


ACTIVE: SharedLaunches | None = None  # the session's, for conftest.py's hooks
RUNNING = ""  # node id of the test running now (conftest.py)


def marked_needs(item) -> list[str]:
    """The shared launches a collected test names in its `launches` marker, its parameters filled in."""
    marker = item.get_closest_marker("launches")
    if marker is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    return [n.format(**params) for n in marker.args]


@pytest.fixture(scope="session", autouse=True)
def launched(tmp_path_factory, request):
    """launched(name) -> Result of the shared launch `name` (a key of CASES), run on first use. Set up
    before the first test, so that the look-ahead fills the cores from the first test on."""
    global ACTIVE
    shared = ACTIVE = SharedLaunches(tmp_path_factory.mktemp("launches"))
    shared.needs = [marked_needs(item) for item in request.session.items]
    shared.index = {item.nodeid: i for i, item in enumerate(request.session.items)}
    yield shared
    ACTIVE = None
    shared.close()


@pytest.fixture
def runs(launched, request) -> list[Result]:
    """The Results of the shared launches this test's `launches` marker names, in the marker's order."""
    names = marked_needs(request.node)
    if not names:
        pytest.fail("the `runs` fixture reads the launches of a @pytest.mark.launches(...) marker; this test has none")
    return [launched(name) for name in names]
