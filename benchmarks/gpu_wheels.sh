#!/usr/bin/env bash
# Before the GPU check, on the machine that has package registries: download into .whl/ (git-ignored)
# the pure-Python packages lit_moe needs that the device machine's image lacks (it holds torch,
# lightning, tensorboard, safetensors, tokenizers, matplotlib, numpy and pyyaml, and reaches no
# registry). gpu_check.sh installs whatever lies in .whl/ into /tmp/site first. Then call the device
# tool with carry [".whl"] and the command `bash benchmarks/gpu_check.sh`.
set -eu
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
# py3-none-any wheels: the same files serve the device's Python 3.12 and this one
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  "jsonargparse==4.53.0" "docstring-parser==0.18.0" "typeshed-client==2.15.0"
ls .whl
