#!/usr/bin/env bash
# The GPU check of issue 18 in one call (about 5 minutes on one H200), from the repository root:
#   bash benchmarks/gpu_check.sh            # CUDA: kernels, then the real `lit_moe fit` on the ~1B-active proxy
#   bash benchmarks/gpu_check.sh --smoke    # tiny sizes on a CPU: every part runs, the numbers mean nothing
# What each part prints: benchmarks/gpu_check.py's docstring. Output also goes to $OUT/gpu_check.log.
set -u
cd "$(dirname "$0")/.."
SMOKE=""
[ "${1:-}" = "--smoke" ] && SMOKE="--smoke"
OUT=${OUT:-/tmp/lit_moe_gpu_check}
mkdir -p "$OUT"
# packages the device image lacks, downloaded beforehand by benchmarks/gpu_wheels.sh and carried in .whl/
SITE=""
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/lit_moe_site .whl/*.whl \
    && SITE="/tmp/lit_moe_site:" || echo "installing .whl/ failed (rc $?)"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:-}"
export TORCHINDUCTOR_CACHE_DIR="$OUT/inductor_cache"
LOG="$OUT/gpu_check.log"
: > "$LOG"
start=$(date +%s)
{
  python3 -c "import sys, torch, lightning, jsonargparse; print('python', sys.version.split()[0], '| torch', torch.__version__, '| lightning', lightning.__version__, '| jsonargparse', jsonargparse.__version__)" \
    || echo "a package lit_moe needs is missing: run benchmarks/gpu_wheels.sh here and carry .whl"
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null || echo "(no nvidia-smi)"
  timeout 60 python3 benchmarks/gpu_check.py kernels $SMOKE || echo "kernels part failed or timed out (rc $?)"
  # the fit's own step lines, warnings about compile/attention, and GpuCheck's table
  timeout 230 python3 benchmarks/gpu_check.py fit $SMOKE --out "$OUT" 2>&1 \
    | grep -E "^(==|   )|^step |rror|torch_compile|lit_moe.ops.sdpa|lit_moe.model.compile|MFU peak|Traceback|Killed|out of memory" \
    || echo "fit part failed or timed out"
  echo "== total $(( $(date +%s) - start )) s"
} 2>&1 | tee -a "$LOG"
