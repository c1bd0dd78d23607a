"""NCCL's collectives over named interconnects, from published nccl-tests figures (busbw: nccl-tests'
doc/PERFORMANCE.md, the rate a collective of S bytes moves at once its bus factor is applied).

  nvlink3   8x A100 SXM over NVSwitch: all_reduce_perf busbw ~200 GB/s at 1 GiB (github.com/NVIDIA/nccl-tests
            issue 149, 8x A100-SXM4-80GB, NCCL 2.17-2.18), 208 GB/s (issue 178)
  nvlink4   8x H100 SXM over NVSwitch: 370 GB/s of NVLink's 450 line rate with the protocol's ~20% overhead,
            what ring collectives reach (NCCL's maintainer, nccl-tests issue 212); NVLink SHARP all-reduce
            ~480 GB/s from a few hundred MiB up (the same; 475 on 8x H200, issue 272): above what DDP's 25 MiB
            buckets reach, so the ring's figure is taken
  pcie3     a PCIe Gen3 x16 GPU's DMA peaks at ~12 GB/s of its 15.75 (V100 ingress, github.com/ZaidQureshi/bam
            issue 54); a ring over PCIe runs at the slowest GPU's link
  pcie4     the same issue: 25 GB/s measured of Gen4 x16's 31.5
  pcie5     Gen4's measured share of its line rate (25 / 31.5) of Gen5's 63 GB/s: 50 (no published figure)
  ib200     DGX A100 with eight 200 Gb/s HDR NICs: 192 GB/s all-reduce busbw across nodes (NCCL's developers,
            quoted in github.com/NVIDIA/nccl issue 1576), 24 GB/s a GPU: 96% of HDR's 25
  ib400     the same share of NDR's 50 GB/s a GPU
Per-call latency (the time of a small collective): ~26 µs on two GPUs behind one PCIe switch (ROCm/rccl issue
362: AMD GPUs under RCCL, NCCL's port; all_reduce_perf 16 B-2 KiB), ~46 µs over two nodes of 8 GPUs with IB
(github.com/NVIDIA/nccl issue 1244, 4 B-1 KiB); over NVLink 10 µs is taken (NVSwitch: one hop, no host in the
path; not from a published table).

Contention: an NCCL collective runs one CTA per channel on an SM of its own for its whole length, taken from
the compute it overlaps: 24 channels on 8 NVSwitch A100s and 2 NVLink H100 PCIe (the NCCL INFO logs of
nccl-tests issues 100 and 194), 4 over PCIe (the "Channel 00-03" P2P logs of tinygrad/open-gpu-kernel-modules
issue 17, 8x RTX 4090). The overlapped backward loses channels / SMs of the time a collective hides under it.
"""
from __future__ import annotations

# name: (busbw GB/s, latency µs, NCCL channels, what it is)
NCCL = {
    "nvlink3": (200.0, 10.0, 24, "A100 NVLink 3 over NVSwitch"),
    "nvlink4": (370.0, 10.0, 24, "H100/H200 NVLink 4 over NVSwitch"),
    "pcie3": (12.0, 26.0, 4, "PCIe Gen3 x16"),
    "pcie4": (25.0, 26.0, 4, "PCIe Gen4 x16"),
    "pcie5": (50.0, 26.0, 4, "PCIe Gen5 x16"),
    "ib200": (24.0, 46.0, 4, "one HDR 200 Gb/s InfiniBand NIC per GPU"),
    "ib400": (48.0, 46.0, 4, "one NDR 400 Gb/s InfiniBand NIC per GPU"),
}
LINKS = tuple(NCCL)


def sm_share(name: str, sms: int) -> float:
    """The share of a GPU's SMs an NCCL collective over `name` holds while it runs."""
    return min(1.0, NCCL[name][2] / max(1, sms))


def link(name: str, gpus_per_node: int = 0, inter: str = "", sms: int = 0):
    """The timemodel Link of a named interconnect; with gpus_per_node and an inter-node link, a Hierarchical
    one: NCCL's all-reduce across nodes is a reduce-scatter inside each node, an all-reduce of each GPU's
    1/g share between the nodes (each GPU over its own NIC), and an all-gather inside the node."""
    from .timemodel import Link

    bw, lat, _, what = NCCL[name]
    source = f"{name} ({what}): nccl-tests busbw {bw:g} GB/s, {lat:g} µs a call"
    base = Link({"all_reduce": bw}, {"all_reduce": lat}, source, sm_share=sm_share(name, sms) if sms else 0.0)
    if not gpus_per_node or not inter:
        return base
    return Hierarchical(base, link(inter), gpus_per_node)


class Hierarchical:
    """Collectives over nodes of `g` GPUs joined by `inter` (Link.ms's signature)."""

    def __init__(self, intra, inter, g: int):
        self.intra, self.inter, self.g = intra, inter, g
        self.meet_ms, self.sm_share = intra.meet_ms, intra.sm_share
        self.source = f"{intra.source}; between nodes of {g}: {inter.source}"

    def ms(self, kind: str, nbytes: float, n: int) -> float:
        if n <= self.g:
            return self.intra.ms(kind, nbytes, n)
        nodes = -(-n // self.g)
        if kind == "all_reduce":  # reduce-scatter in the node, all-reduce of 1/g across nodes, all-gather in the node
            inter = self.inter.ms("all_reduce", nbytes / self.g, nodes)
            return self.intra.ms("reduce_scatter", nbytes, self.g) + inter + self.intra.ms("all_gather", nbytes, self.g)
        # gathers and scatters: each GPU's share crosses its NIC once; the node's part rides NVLink beside it
        return max(self.intra.ms(kind, nbytes, self.g), self.inter.ms(kind, nbytes, n))
