#!/bin/bash
# Prints the network interface this node reaches ADDR through (run on every node of a job of several
# nodes by slurm/torchrun.sbatch and slurm/accelerate.sbatch, which export it as GLOO_SOCKET_IFNAME):
#
#   bash slurm/node_ifname.sh ADDR
#
# The interface that holds ADDR on the node it belongs to (the first node: ADDR is its own address from
# slurm/node_addr.sh, and `ip route get` would answer lo), else the one the route to ADDR leaves by.
# Why gloo needs it named: without GLOO_SOCKET_IFNAME, gloo listens on the address the host name resolves
# to whenever a socket can bind it, loopback included (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
# createDefaultDevice and doesHostnameResolveToUsableAddress). Stock Debian and Ubuntu map the host name to
# 127.0.1.1, so a rank there tells its peers on other nodes an address they cannot reach, and the group's
# connectFullMesh waits out its timeout (FSDP --cpu-offload's gloo group; every group on CPU nodes).
# Prints nothing and exits 1 without iproute2's `ip`; the templates then leave gloo to its default.
set -u
ADDR=${1:?usage: node_ifname.sh ADDR}
command -v ip >/dev/null || exit 1
ifname=$(ip -o -4 addr show to "$ADDR" 2>/dev/null | awk 'NR == 1 {print $2}')
if [ -z "$ifname" ]; then
    ifname=$(ip -o route get "$ADDR" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
fi
[ -n "$ifname" ] || exit 1
echo "$ifname"
