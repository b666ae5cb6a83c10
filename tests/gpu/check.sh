#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (docs/worker.md "On a GPU"):
#   1. the torch tests on CUDA (QOS_TEST_DEVICE=cuda: tests/support/torch_device.py): the
#      model's exactness, the engine's determinism and resumption, run_local, and the worker
#      end to end against a private redis-server;
#   2. tests/bench_torch_gpu.py: step costs of the 1B preset and their fit to the sim cost
#      model, the long-prefill stall with real steps, resumption in bf16;
#   3. `qos up --engine torch --device cuda --demo-load`: every role as its own process;
#   4. `qos bench scale-out` on the machine's cores (no GPU needed: the null engine), the
#      clients in processes of their own: issue 17's three pools over one (>= 2.7x), which
#      a 2-core box cannot show (docs/scaling.md). SCALE_S=0 skips it.
# Needs .gpu/ from tests/gpu/bundle.sh (wheels, redis-server). Run from the repo root:
#   bash tests/gpu/check.sh          # writes its logs to $OUT (default /tmp/gpu-check)
# Each part has its own time limit, so one that hangs still leaves the others' results.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu-check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 QOS_LOG_LEVEL=${QOS_LOG_LEVEL:-WARNING}
say() { printf '\n=== %s (%s)\n' "$*" "$(date -u +%T)"; }

say "machine"
nvidia-smi -L 2>&1 || echo "no nvidia-smi"
if [[ "${SKIP_INSTALL:-0}" != "1" ]]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/whl/*.whl || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
  mkdir -p /tmp/gpu-bin
  for exe in redis-server redis-cli; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$PWD/.gpu/lib" "$PWD/.gpu/bin/$exe" > /tmp/gpu-bin/$exe
    chmod +x /tmp/gpu-bin/$exe
  done
  export PATH=/tmp/gpu-bin:$PATH
fi
$PY -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
redis-server --version || { echo "redis-server does not run here"; exit 1; }
DEVICE=${QOS_TEST_DEVICE:-cuda}

say "1. torch tests on $DEVICE"
# the machine's other pytest plugins (xdist, cov, benchmark...) stay out: only the ones CI uses
PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 QOS_TEST_DEVICE=$DEVICE timeout -k 10 ${TESTS_S:-150} \
  $PY -m pytest -q -p no:cacheprovider -p pytest_asyncio.plugin -p pytest_timeout -rs \
  tests/test_model.py tests/test_engines.py tests/test_local_run.py tests/test_worker_e2e.py 2>&1 \
  | tee "$OUT/tests.txt" | tail -40
echo "tests: rc ${PIPESTATUS[0]}"

say "2. bench_torch_gpu"
timeout -k 10 ${BENCH_S:-210} $PY tests/bench_torch_gpu.py --device "$DEVICE" ${BENCH_ARGS:-} 2>&1 \
  | tee "$OUT/bench.txt"
echo "bench: rc ${PIPESTATUS[0]}"

say "3. qos up --engine torch --device $DEVICE --demo-load"
timeout -s INT -k 30 ${UP_S:-75} $PY -m limiter.cli up --engine torch --device "$DEVICE" --workers 2 \
  --port 18000 --demo-load --demo-duration ${DEMO_S:-30} > "$OUT/up.txt" 2>&1
echo "qos up: rc $?"
grep -v '^\s*$' "$OUT/up.txt" | tail -30

if [[ "${SCALE_S:-110}" != "0" ]]; then
  say "4. qos bench scale-out on $(nproc) cores"
  # 3 masters + 4 frontends + 3 workers + 4 client processes: 14 processes, a core each
  timeout -s INT -k 20 ${SCALE_S:-110} $PY -m limiter.cli bench scale-out --frontends 4 --workers 1 \
    --client-processes 4 --concurrency 32 --seconds 10 --markdown --out "$OUT/scale-out" \
    > "$OUT/scale-out.txt" 2>&1
  echo "scale-out: rc $?"
  grep -v '^\s*$' "$OUT/scale-out.txt" | tail -40
fi
