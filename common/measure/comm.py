"""What each rank sends: every collective of the `comm_steps` optimizer steps right after the warm-up
(before the timed window opens), recorded with torch.profiler, and the volume each strategy is
expected to send.

Source of truth: the backend's own work events, `gloo:<op>` / `nccl:<op>` (ProcessGroupGloo and
ProcessGroupNCCL record them with the op's input tensors, so shapes and dtypes come with them). The
dispatcher events around them (`c10d::allreduce_`, `c10d::_reduce_scatter_base_`) and NCCL's
`record_param_comms` describe the same call a second time and are not counted; `nccl:coalesced`
(a group of ops already counted one by one) and barriers are not payload. What the backend ran is
what counts: gloo carries FSDP's reduce-scatter as a `gloo:all_reduce` of the full input, so the
row counts it as an all-reduce of that size (same bytes, all-reduce bus factor). The harness's own
collectives (metrics, the non-finite check at --log-every steps) run inside a `harness:collective`
range (common/distributed.py) and are left out: the row is what the strategy sends.

Columns, per optimizer step and per rank, mean over ranks:
  comm_bytes_per_step  message size S as nccl-tests counts it (PERFORMANCE.md): all-reduce,
                       reduce-scatter, broadcast and reduce: the full buffer; all-gather: the gathered
                       output (the recorded input shard x its group's size: the dispatcher's record
                       of the call, else the world size).
  comm_calls_per_step  backend collectives issued.
  comm_ms_per_step     wall time with at least one collective in flight: on CPU the gloo worker
                       threads' spans (a send's or receive's: from its issue to its wait, on the issuing
                       thread), on GPU the NCCL kernels' (the CPU-side nccl event only enqueues).
                       It includes waiting for the slowest rank to arrive, as nccl-tests' timing does.
  busbw_gbps           sum(S x bus factor) / comm time, GB/s (1e9): factors 2(n-1)/n all-reduce,
                       (n-1)/n all-gather, reduce-scatter and all-to-all, 1 broadcast and reduce; n the
                       call's group where recorded (_gather_groups, _param_groups), else the world.
  comm_overlap_pct     share of comm_ms during which compute ran at the same time: on GPU non-NCCL
                       kernels on any stream, on CPU aten ops on the training threads (not the gloo
                       workers, not waits, not the copies inside a collective's dispatcher op). On CPU
                       both share the same cores, so overlap there means concurrency, not that the
                       cost was hidden.

The profiled steps run before the timed window opens (common/train.py TimedWindow): recording
shapes and, on GPU, CUDA activity costs per op, and stopping the profiler processes the trace, so no
other instrument (throughput, step times, memory peaks, utilization, energy, pipeline bubble) sees
them. A run with no more steps left than comm_steps profiles inside its window (nothing else to time).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

import torch

from ..distributed import HARNESS, reduce_metrics, synchronize, world_size
from . import Instrument

# backend op name (after "gloo:" / "nccl:") -> the nccl-tests kind it is timed and counted as
KINDS = {
    "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce", "sparse_all_reduce": "all_reduce",
    "all_gather": "all_gather", "_all_gather_base": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast": "broadcast", "_broadcast_oop": "broadcast", "reduce": "reduce", "_reduce_oop": "reduce",
    "all_to_all": "all_to_all", "gather": "gather", "gather_single": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "recvAnySource": "recv",
}
# record_param_comms' dtype names (c10 ScalarType) -> bytes
PARAM_COMMS_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2,
                     "Char": 1, "Byte": 1, "Bool": 1}
ELEMENT_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "long int": 8, "int": 4,
                 "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1}


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests' busBw / algBw (doc/PERFORMANCE.md)."""
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0


def message_bytes(kind: str, shapes, dtypes, n: int) -> int:
    """S of one call from its recorded input tensors (all-gather records the shard)."""
    total = 0
    for shape, dtype in zip(shapes, dtypes):
        if dtype in ELEMENT_BYTES and isinstance(shape, list):
            numel = 1
            for d in shape:
                numel *= d
            total += numel * ELEMENT_BYTES[dtype]
    return total * n if kind == "all_gather" else total


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _length(intervals) -> int:
    return sum(b - a for a, b in intervals)


def _intersection(xs, ys) -> int:
    """Length of the intersection of two sorted unions."""
    i = j = total = 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def _subtract(xs, ys) -> list[tuple[int, int]]:
    """The parts of sorted union xs not covered by sorted union ys."""
    out, j = [], 0
    for a, b in xs:
        while j < len(ys) and ys[j][1] <= a:
            j += 1
        k, lo = j, a
        while k < len(ys) and ys[k][0] < b:
            if ys[k][0] > lo:
                out.append((lo, ys[k][0]))
            lo = max(lo, ys[k][1])
            k += 1
        if lo < b:
            out.append((lo, b))
    return out


PHASE = "phase:"  # common/train.py names the loop's phases with record_function while profiling


def _annotation(e) -> bool:
    """A user annotation (record_function) mirrored on the device timeline: a range, not a kernel."""
    try:
        return bool(e.is_user_annotation())
    except (AttributeError, RuntimeError):
        return False


def _gather_groups(events) -> dict[tuple, list[int]]:
    """Group size of each all_gather_into_tensor call, keyed by its input shape, in call order: the
    dispatcher event `c10d::_allgather_base_` records the output and the input (the backend's event
    only the input shard). A collective on a sub-group (FSDP's shard group under --sharding hybrid:
    LOCAL_WORLD_SIZE ranks, not the world) gathers input x group size, not x world size."""
    groups: dict[tuple, list[int]] = {}
    for e in sorted((e for e in events if e.name() == "c10d::_allgather_base_"), key=lambda e: e.start_ns()):
        shapes = e.shapes()
        if len(shapes) >= 2 and shapes[0] and shapes[1]:
            out, inp = math.prod(shapes[0]), math.prod(shapes[1])
            if inp:
                groups.setdefault(tuple(shapes[1]), []).append(out // inp)
    return groups


def _param_groups(events) -> dict[tuple, list[int]]:
    """Group size of each NCCL collective, keyed by (kind, input elements), in call order: ProcessGroupNCCL
    records every collective as record_param_comms with its "Group size" (the process group's, RECORD_PARAM_COMMS_DATA's
    worldSize; torch/testing/_internal/distributed/distributed_test.py _sanity_check_profiler_nccl_meta reads
    it), and its nccl:<op> event carries no group. A sub-group's all-reduce (pytorch_TP.py's tp group under
    dp > 1, --sharding hybrid's replicate group) has the bus factor of its group, not of the world. Gloo
    records none: there the world size stands."""
    groups: dict[tuple, list[int]] = {}
    for e in sorted((e for e in events if e.name() == "record_param_comms"), key=lambda e: e.start_ns()):
        meta = _meta(e)
        name, size = str(meta.get("Collective name", "")).replace("_", "").lower(), meta.get("Group size")
        kind = next((k for k, key in (("all_reduce", "allreduce"), ("reduce_scatter", "reducescatter"),
                                      ("all_gather", "allgather"), ("broadcast", "broadcast")) if key in name), None)
        if kind and size:
            groups.setdefault((kind, int(meta.get("In msg nelems") or 0)), []).append(int(size))
    return groups


def _meta(e) -> dict:
    """A kineto event's metadata (record_param_comms: Collective name, dtype, In msg nelems, ...), its
    string values unquoted: kineto keeps them as '"send"' (torch/autograd/profiler_util.py _to_str)."""
    try:
        meta = e.extra_meta() or {}
    except (AttributeError, RuntimeError):
        return {}
    return {k: v.strip('"') if isinstance(v, str) else v for k, v in meta.items()}


@dataclass
class _Seen:
    """What analyze() gathers from one pass over the events."""
    calls: int = 0
    payload: int = 0
    bus_bytes: float = 0.0
    cpu_comm: list = field(default_factory=list)
    threads: set = field(default_factory=set)  # gloo's worker threads (their collectives' runs)
    gpu_comm: list = field(default_factory=list)
    gpu_compute: list = field(default_factory=list)
    cpu_ops: list = field(default_factory=list)
    launches: list = field(default_factory=list)
    gpu_phases: dict = field(default_factory=dict)

    def count(self, size: int, bus: float) -> None:
        self.calls, self.payload, self.bus_bytes = self.calls + 1, self.payload + size, self.bus_bytes + bus


def _p2p(events) -> list:
    """NCCL point-to-point inside a coalescing group (batch_isend_irecv: every pipeline schedule's sends and
    receives) gets no nccl:send / nccl:recv event of its own: ProcessGroupNCCL's pointToPoint only records the
    op for the flight recorder while coalescing, and endCoalescing's work is a shapeless `nccl:coalesced`
    (torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp, initWork(..., "nccl:coalesced", {}, {})). Every send()
    and recv() first records record_param_comms with its element count and dtype (RECORD_PARAM_COMMS_DATA,
    coalesced or not), so on NCCL the point-to-point traffic is counted from those, and nccl:send/recv not
    again."""
    return [e for e in events if e.name() == "record_param_comms"
            and (_meta(e).get("Collective name") in ("send", "recv"))]


def _device_event(seen: _Seen, e, name: str, span) -> None:
    if name.startswith(PHASE):  # the loop's phase ranges on the device timeline
        seen.gpu_phases.setdefault(name[len(PHASE):], []).append(span)
    elif not _annotation(e):  # a range, not a kernel: neither comm nor compute
        (seen.gpu_comm if "nccl" in name.lower() else seen.gpu_compute).append(span)


def _collective(seen: _Seen, e, span, op: str, backend: str, n: int, gathers, params) -> None:
    kind, group = KINDS[op], n
    first = tuple(e.shapes()[0] or ()) if e.shapes() else ()
    if kind == "all_gather" and gathers.get(first):
        group = gathers[first].pop(0)
    elif params.get((kind, math.prod(first))) and first:
        group = params[(kind, math.prod(first))].pop(0)
    size = message_bytes(kind, e.shapes(), e.dtypes(), group)
    seen.count(size, size * bus_factor(kind, group))
    if backend == "gloo":
        seen.cpu_comm.append(span)
        # A collective's event is its worker thread's run; a send's or a receive's is the caller's own:
        # SendWork and RecvWork pass "gloo:send"/"gloo:recv" to the Work constructor, which opens the range
        # on the issuing (training) thread, and wait() closes it (ProcessGroupGloo.cpp, SendWork::wait ->
        # finishAndThrow). So a pipeline's send spans the stage's next forward: that thread's ops stay
        # compute, and only its wait is exposed.
        if kind not in ("send", "recv"):
            seen.threads.add(e.start_thread_id())


def _gather(events, n: int) -> _Seen:
    """One pass over the events: collectives counted, spans of communication and compute by thread and device.
    The harness waits for its collectives inside its range (on CUDA it synchronizes there): a collective, or
    an NCCL kernel, that starts inside one is the harness's."""
    seen, gathers, p2p, params = _Seen(), _gather_groups(events), _p2p(events), _param_groups(events)
    harness = _union([(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == HARNESS])
    starts, p2p_ids = [a for a, _ in harness], {id(e) for e in p2p}
    for e in sorted(events, key=lambda e: e.start_ns()):
        name, span = e.name(), (e.start_ns(), e.start_ns() + e.duration_ns())
        at = bisect.bisect_right(starts, span[0]) - 1
        if at >= 0 and span[0] <= harness[at][1]:
            continue
        if e.device_type() == torch.autograd.DeviceType.CUDA:
            _device_event(seen, e, name, span)
            continue
        backend, _, op = name.partition(":")
        if p2p and backend == "nccl" and op in ("send", "recv"):
            continue  # counted from its record_param_comms
        if id(e) in p2p_ids:
            meta = _meta(e)
            size = int(meta.get("In msg nelems") or 0) * PARAM_COMMS_BYTES.get(str(meta.get("dtype")), 0)
            seen.count(size, size)
        elif backend in ("gloo", "nccl") and op in KINDS:
            _collective(seen, e, span, op, backend, n, gathers, params)
        elif name.startswith("aten::") and "wait" not in name:
            seen.cpu_ops.append((e.start_thread_id(), span))
        elif backend == "c10d" and "barrier" not in op and "wait" not in op:
            seen.launches.append((e.start_thread_id(), span))
    return seen


def _phase_spans(events, seen: _Seen) -> dict:
    """The loop's phase ranges: on GPU the device's copy of each (the host runs ahead of the device), on CPU the
    host's; a step run inside backward (accelerate's DeepSpeed engine, common/train.py step_inside_backward) is
    the optimizer's alone, not compute's as well."""
    phases = seen.gpu_phases if seen.gpu_comm and seen.gpu_phases else {}
    if not phases:
        for e in events:
            if e.name().startswith(PHASE) and e.device_type() != torch.autograd.DeviceType.CUDA:
                phases.setdefault(e.name()[len(PHASE):], []).append((e.start_ns(), e.start_ns() + e.duration_ns()))
    if "compute" in phases and "optimizer" in phases:
        phases = {**phases, "compute": _subtract(_union(phases["compute"]), _union(phases["optimizer"]))}
    return phases


def analyze(events, n: int, steps: int) -> dict:
    """The columns from profiler events (torch's _KinetoEvent: name(), shapes(), dtypes(), start_ns(),
    duration_ns(), start_thread_id(), device_type() -- what torch.autograd.profiler builds its
    FunctionEvents from; FunctionEvent drops the dtypes)."""
    seen = _gather(events, n)
    comm = _union(seen.gpu_comm if seen.gpu_comm else seen.cpu_comm)
    # On CPU the training thread does part of a collective's work inside its dispatcher op, before the
    # gloo thread takes over: gloo's reduce-scatter clones its whole input there
    # (ProcessGroupGloo::reduce_scatter_tensor_coalesced, then an all-reduce of the clone). That is
    # communication, as benchmarks/collectives.py times it, not the model's compute. (On GPU a launch
    # only enqueues: the kernels say what ran.)
    launch = [] if seen.gpu_comm else _union([s for t, s in seen.launches if t not in seen.threads])
    compute = _union(seen.gpu_compute) if seen.gpu_comm else \
        _subtract(_union([s for t, s in seen.cpu_ops if t not in seen.threads]), launch)
    comm_ns = _length(comm)
    # exposed: a collective in flight (or launching) and no compute on the training side, attributed to
    # the loop's phase it fell in (common/measure/stepparts.py takes it out of that phase)
    exposed = _subtract(_union(comm + launch), compute)
    phases = _phase_spans(events, seen)
    by_phase = ({p: _intersection(exposed, _union(spans)) / 1e6 / steps for p, spans in phases.items()}
                if phases else None)  # no phase recorded: not measured (never a silent 0)
    return {"comm_bytes_per_step": seen.payload / steps, "comm_calls_per_step": seen.calls / steps,
            "comm_ms_per_step": comm_ns / 1e6 / steps if comm_ns else None,
            "busbw_gbps": seen.bus_bytes / comm_ns if comm_ns else None,  # bytes per ns = GB/s
            "comm_overlap_pct": 100.0 * _intersection(comm, compute) / comm_ns if comm_ns else None,
            "exposed_ms_by_phase": by_phase}


COLUMNS = ("comm_bytes_per_step", "comm_calls_per_step", "comm_ms_per_step", "busbw_gbps", "comm_overlap_pct")


class CommRecorder(Instrument):
    """Profiles `steps` optimizer steps right after the warm-up, before the window opens (stopped early
    at an epoch end)."""

    def __init__(self, steps: int, device: torch.device):
        self.steps, self.device, self.outside_window = steps, device, steps
        self.prof, self.done = None, 0
        self.events: list | None = None
        self._local: dict | None = None

    def start(self) -> None:
        if self.prof is not None or self.events is not None:
            return  # once per process
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=activities, record_shapes=True)
        self.prof.start()

    def step(self) -> None:
        if self.prof is not None:
            self.done += 1
            if self.done >= self.steps:
                self._finish()

    def pause(self) -> None:
        if self.prof is not None:
            self._finish()

    def stop(self) -> None:
        self.pause()
        if self.done == 0:  # the epoch ended before a profiled step: nothing recorded, ready to start again
            self.events = None

    def _finish(self) -> None:
        synchronize(self.device)
        self.prof.stop()
        self.events = self.prof.profiler.kineto_results.events()
        self.prof = None

    def local(self) -> dict:
        if self.events is None or not self.done:  # nothing recorded (yet): not cached
            return dict.fromkeys(COLUMNS)
        if self._local is None:
            self._local = analyze(self.events, world_size(), self.done)
        return self._local

    def exposed_ms_per_step(self) -> dict | None:
        """{phase: ms per step} of exposed communication over the profiled steps, None if none were."""
        return self.local().get("exposed_ms_by_phase")

    def row(self) -> dict:
        if world_size() == 1:  # a world of one sends nothing: its collectives' time is only step_comm_exposed_ms
            return dict.fromkeys(COLUMNS)
        local = {k: v for k, v in self.local().items() if k != "exposed_ms_by_phase"}
        out = reduce_metrics(local, self.device, "mean")
        return {k: None if v is None else round(v, 3) for k, v in out.items()}
