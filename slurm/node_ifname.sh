#!/bin/bash
# Prints the network interface this node reaches ADDR through (run on every node of a job of several
# nodes by slurm/torchrun.sbatch and slurm/accelerate.sbatch, which export it as GLOO_SOCKET_IFNAME):
#
#   bash slurm/node_ifname.sh ADDR
#
# ADDR: an IPv4 address, or a host name (its first IPv4 address). The interface that holds ADDR on the node
# it belongs to (the first node: ADDR is its own address from slurm/node_addr.sh, and `ip route get` would
# answer lo), else the one the route to ADDR leaves by. Never loopback.
# Why gloo needs it named: without GLOO_SOCKET_IFNAME, gloo listens on the address the host name resolves
# to whenever a socket can bind it, loopback included (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp,
# createDefaultDevice and doesHostnameResolveToUsableAddress). Stock Debian and Ubuntu map the host name to
# 127.0.1.1, so a rank there tells its peers on other nodes an address they cannot reach, and the group's
# connectFullMesh waits out its timeout (FSDP --cpu-offload's gloo group; every group on CPU nodes).
# Without iproute2's `ip`, or with no interface but loopback, it says why on stderr and exits 1: the
# templates then leave gloo to its default.
set -u
ADDR=${1:?usage: node_ifname.sh ADDR}
fail() { echo "node_ifname.sh: $(hostname): $1; gloo keeps its default (set GLOO_SOCKET_IFNAME)" >&2; exit 1; }
command -v ip >/dev/null || fail "no ip command (iproute2)"
case $ADDR in
    *[!0-9.]*) ADDR=$(getent ahostsv4 "$ADDR" 2>/dev/null | awk 'NR == 1 {print $1}')
               [ -n "$ADDR" ] || fail "${1} has no IPv4 address" ;;
esac
ifname=$(ip -o -4 addr show to "$ADDR" 2>/dev/null | awk '$2 != "lo" {print $2; exit}')
if [ -z "$ifname" ]; then
    ifname=$(ip -o route get "$ADDR" 2>/dev/null | awk '{for (i = 1; i < NF; i++) if ($i == "dev") {print $(i + 1); exit}}')
fi
case $ifname in
    ""|lo) fail "no interface but loopback reaches $ADDR" ;;
esac
echo "$ifname"
