#!/usr/bin/env bash
# The GPU check, run from the repository root on a machine with an NVIDIA GPU and no network:
#   1. the tests marked `cuda` (python3 -m pytest -m cuda tests);
#   2. benchmarks/gpu.py, tokenriver against transformers on the same GPU (arguments given to this script go to it,
#      e.g. `bash benchmarks/gpu_check.sh --repeats 2` where less GPU time is at hand).
# Both always run; the exit status is non-zero if either failed.
#
# tokenriver runs from the source tree (PYTHONPATH=src), not pip-installed. Python packages the machine's image
# lacks travel as wheels in .whl/ at the repository root (benchmarks/gpu_wheels.txt lists them and says how to
# download them); they are installed into /tmp/tokenriver-site, without network or dependency resolution.
#
# The log (and gpu.md, gpu.png) go to $GPU_CHECK_LOG_DIR, default benchmarks/results. The two timeouts
# ($GPU_CHECK_TEST_TIMEOUT, default 120 s; $GPU_CHECK_BENCH_TIMEOUT, default 450 s) keep the whole check under
# ten minutes.
set -euo pipefail

cd "$(dirname "$0")/.."
log_dir="${GPU_CHECK_LOG_DIR:-benchmarks/results}"
mkdir -p "$log_dir"
log="$log_dir/gpu_check.log"
: > "$log"

# The CUDA path never calls the native CPU kernels; the CPU references some cuda tests compare with run their
# PyTorch definitions, so nothing is compiled here.
export TOKENRIVER_NATIVE_KERNELS=0

site=/tmp/tokenriver-site
if [ -d .whl ] && compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check --root-user-action=ignore \
        --target "$site" .whl/*.whl 2>&1 | tee -a "$log"
    export PYTHONPATH="src:$site${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "no .whl/ folder: relying on the image's packages" | tee -a "$log"
    export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
fi

{
    echo "== machine"
    nvidia-smi -L || echo "nvidia-smi failed"
    python3 -c 'import sys, torch, transformers
print("python", sys.version.split()[0], "| torch", torch.__version__, "(CUDA", torch.version.cuda, ")",
      "| transformers", transformers.__version__, "| GPU visible:", torch.cuda.is_available())'
} 2>&1 | tee -a "$log"

echo "== tests marked cuda" | tee -a "$log"
tests_status=0
timeout "${GPU_CHECK_TEST_TIMEOUT:-120}" python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 \
    | tee -a "$log" || tests_status=$?
if [ "$tests_status" -eq 5 ]; then
    echo "pytest collected no test marked cuda" | tee -a "$log"
fi

echo "== benchmarks/gpu.py (${SECONDS} s into the check)" | tee -a "$log"
bench_status=0
timeout "${GPU_CHECK_BENCH_TIMEOUT:-450}" python3 benchmarks/gpu.py --out-dir "$log_dir" "$@" 2>&1 \
    | tee -a "$log" || bench_status=$?

echo "== tests: exit $tests_status, benchmark: exit $bench_status (124: timed out), ${SECONDS} s in all" | tee -a "$log"
[ "$tests_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
