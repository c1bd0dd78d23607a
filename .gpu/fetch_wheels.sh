#!/usr/bin/env bash
# Before a lease, on this machine: the Python packages the GPU tier needs that the device's image lacks
# (/work/.library/device/KINDS.md lists its packages: no deepspeed, hjson or pydantic), as wheels in .whl/
# (git ignores it). Each call that runs DeepSpeed carries them: carry [".whl", ...]; .gpu/run.sh installs them
# into /tmp/site when .whl/ is there. DeepSpeed is published as a source distribution only: its wheel is built
# here without its CUDA ops (DS_BUILD_OPS=0, the default: they are JIT-built where used; the scripts use none).
# Run from the repository root, with the project's venv active: bash .gpu/fetch_wheels.sh
set -euo pipefail
rm -rf .whl && mkdir -p .whl
DS_BUILD_OPS=0 python -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
  hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing-extensions==4.16.0  # pydantic 2.14's floor; the image's own version is not known (KINDS.md names it only)
ls .whl; du -sh .whl
