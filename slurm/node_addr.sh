#!/bin/bash
# Prints the address the other nodes of a job reach this node at, for the rendezvous (run on the first
# node by slurm/torchrun.sbatch and slurm/accelerate.sbatch):
#
#   bash slurm/node_addr.sh NODES
#
# $RDZV_ADDR when set; else the first IPv4 address that is not loopback, of those the host name resolves
# to (`hostname --ip-address`) and then of the configured interfaces (`hostname --all-ip-addresses`).
# A loopback address is refused for a job of several nodes: stock Debian and Ubuntu map the host name to
# 127.0.1.1 in /etc/hosts, and torch's c10d rendezvous treats any loopback endpoint as this machine
# (torch/distributed/elastic/rendezvous/utils.py _matches_machine_hostname), so every node would serve
# a store of its own and wait out the join timeout. With one node, loopback is what it needs.
set -u
NODES=${1:-2}
if [ -n "${RDZV_ADDR:-}" ]; then
    echo "$RDZV_ADDR"
    exit 0
fi
resolved=$(hostname --ip-address 2>/dev/null || true)
for addr in $resolved $(hostname --all-ip-addresses 2>/dev/null || true); do
    case $addr in
        127.*|0.0.0.0|*:*) continue ;;  # loopback, unspecified; IPv6 would need [brackets] in the endpoint
    esac
    echo "$addr"
    exit 0
done
first=$(echo "$resolved" | awk '{print $1}')
if [ "$NODES" -le 1 ] && [ -n "$first" ]; then
    echo "$first"
    exit 0
fi
echo "node_addr.sh: $(hostname) has no IPv4 address but loopback (hostname --ip-address: ${first:-none}), which the" \
     "other nodes cannot reach: set RDZV_ADDR to this node's address on the network they share" >&2
exit 1
