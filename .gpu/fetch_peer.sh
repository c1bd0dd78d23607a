#!/usr/bin/env bash
# Before a lease, on this machine (the device has no network): put the peer trainer where the lease's copy of
# the tree finds it. NVIDIA DeepLearningExamples' PyTorch ResNet50 v1.5 trainer (PyTorch/Classification/
# ConvNets) and NVIDIA dllogger (its one dependency outside PyPI: requirements.txt names it by git URL), from
# their mirrors (the `fetch` tool: github:NVIDIA/DeepLearningExamples, github:NVIDIA/dllogger), into
# shared/peer/. git ignores it: their code stays out of this repository. The run tool carries it:
# carry ["shared/peer"]. Run from the repository root: bash .gpu/fetch_peer.sh
set -euo pipefail
MIRROR=${MIRROR:-/work/.mirror}
DLE=$MIRROR/NVIDIA+DeepLearningExamples/repo
DLL=$MIRROR/NVIDIA+dllogger/repo
DLE_REV=${DLE_REV:-729963dd}  # the mirror's newest snapshot (release 24.03), the revision the lease pins
DLL_REV=${DLL_REV:-v1.0.0}    # the tag ConvNets' requirements.txt pins
rm -rf shared/peer && mkdir -p shared/peer/dllogger
git --git-dir="$DLE" archive "$DLE_REV" PyTorch/Classification/ConvNets | tar -x -C shared/peer --strip-components=2
git --git-dir="$DLL" archive "$DLL_REV" | tar -x -C shared/peer/dllogger
echo "DeepLearningExamples $DLE_REV, dllogger $DLL_REV" > shared/peer/REVISIONS
echo "shared/peer: $(cat shared/peer/REVISIONS)"
