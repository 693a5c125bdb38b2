#!/usr/bin/env bash
# Every GPU check in one device command of at most 9 minutes, for a one-GPU machine prepared as
# ../shared/tools/gpu_wheels.sh says (its image's own torch; PuLP and highspy from .whl/):
#   bash benchmarks/gpu_checks.sh OUT          # give the device command timeout_s 590
# Logs go to OUT (default gpu-logs/), each part alone on the machine, in this order:
#   env.txt     the device, driver and package versions
#   gpu.log     make test-gpu (tests marked gpu: the zoo trains on CUDA like eager)
#   bench.log   benchmarks/one_gpu.py: every zoo model in bf16, then in fp32, eager and
#               torchalpa, measured beside the plan's estimate (step, memory), a process per
#               variant, BENCH_JOBS (3) processes at once with one at a time holding the GPU
#               for its timed steps; rows print as they finish, so a part cut short keeps what
#               it measured
#   overlap.log benchmarks/gpu_overlap.py: host-link copies and a copy kernel on a side stream
#               beside matmuls: bandwidth, exposed fraction, compute slowdown
#   calib.log   torchalpa calibrate: the device's matmul/bandwidth/op/attention rates
#               (device_profile.json: the stored profile, copied beside the logs)
#   ops.log     benchmarks/op_times.py: GPT-2 small bf16, each op timed alone beside its price
#   suite.log, bf16_profile.log: off by default (SUITE_T=0, PROFILE_T=0); the not-slow suite
#               on this machine and a bf16 step's profile
# Each part has its own time limit in seconds (GPU_T, BENCH_T, OVERLAP_T, CALIB_T, OPS_T,
# SUITE_T, PROFILE_T; 0 skips a part); a part cut short says so in its log. DTYPES picks the
# bench's rows ("bf16 fp32"). One process at a time (BENCH_JOBS=1), as on the H200 on
# 2026-11-28, the bench took 250 s for the bf16 rows and 271 s for the fp32 ones: then run
# DTYPES=bf16 and DTYPES=fp32 as two commands.
set -u
out=${1:-gpu-logs}; mkdir -p "$out"
GPU_T=${GPU_T:-120} BENCH_T=${BENCH_T:-330} OVERLAP_T=${OVERLAP_T:-30} CALIB_T=${CALIB_T:-30}
OPS_T=${OPS_T:-30} SUITE_T=${SUITE_T:-0} PROFILE_T=${PROFILE_T:-0}
DTYPES=${DTYPES:-bf16 fp32} BENCH_JOBS=${BENCH_JOBS:-3}
py="python3 -P"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . \
    || { echo "install failed" > "$out/env.txt"; exit 1; }
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cpu XLA_PYTHON_CLIENT_PREALLOCATE=false
{ date; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $py -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, torch.version.cuda, torch.cuda.get_device_name())';
  $py -m pip list 2>/dev/null | grep -iE "^(transformers|torchvision|pulp|highspy|networkx|numpy|rich|pytest|pytest-xdist|jax) "; } > "$out/env.txt" 2>&1
export TORCHALPA_CACHE_DIR="${TORCHALPA_CACHE_DIR:-/tmp/torchalpa-cache}"
part() {  # name limit command...: run it alone, log how it ended
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 0 ] || return 0
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s (124: cut at $limit s)" >> "$out/$name.log"
}
part gpu "$GPU_T" $py -m pytest -q -p no:cacheprovider -m gpu --tb=short -rfE tests
bench_rows() {  # the rows of each dtype in turn
  for dtype in $DTYPES; do
    $py benchmarks/one_gpu.py --steps 10 --warmup 3 --no-compile --jobs "$BENCH_JOBS" \
      --variants eager torchalpa --dtypes "$dtype" \
      --models llama1b bert vit moe gpt2 resnet gpt_small || return
  done
}
export py DTYPES BENCH_JOBS
part bench "$BENCH_T" bash -c "$(declare -f bench_rows); bench_rows"
part overlap "$OVERLAP_T" $py benchmarks/gpu_overlap.py
part calib "$CALIB_T" $py -m torchalpa calibrate
profile=$(ls "$TORCHALPA_CACHE_DIR"/calibration/gpu-*.json 2>/dev/null | head -1)
[ -n "$profile" ] && cp "$profile" "$out/device_profile.json"
part ops "$OPS_T" env PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
  $py benchmarks/op_times.py --model gpt2 --dtype bf16 --cluster h200
part suite "$SUITE_T" $py -m pytest -p no:cacheprovider -m "not slow and not gpu" -n 12 \
  -v --tb=short -rfE tests
part bf16_profile "$PROFILE_T" $py benchmarks/bf16_profile.py --models bert vit gpt_small
