#!/usr/bin/env bash
# Every GPU check in one go, for a one-GPU machine prepared as ../shared/tools/gpu_wheels.sh
# says (its image's own torch; PuLP and highspy from .whl/). Logs go to $1 (default gpu-logs/):
#   env.txt     the device, driver and package versions
#   gpu.log     make test-gpu (tests marked gpu: the zoo trains on CUDA like eager)
#   suite.log   the rest of the suite (not slow) on the same machine, GPU visible, run
#               beside gpu.log (multi-rank tests stay on gloo/CPU; JAX kept on the CPU)
#   bench.log   benchmarks/one_gpu.py, alone on the machine once the tests are done
#   bf16_profile.log  benchmarks/bf16_profile.py after it: where a bf16 step's time goes,
#               eager autocast vs torchalpa (host issue time, GPU kernel time, syncs, the
#               top kernels, which attention kernels ran), model by model
# Each part has its own time limit (seconds: GPU_T, SUITE_T, BENCH_T, PROFILE_T) so the
# whole fits a lease; a part cut short says so in its log (BENCH_T=0 or PROFILE_T=0 skips
# that part). With the defaults the parts take up to 330 + 170 + 150 s: under a 600-s limit
# per command, pass BENCH_T=0 or PROFILE_T=0 and run the other in a second call. The
# suite's log names each test as it ends (-v), so a run cut short still says what failed.
set -u
out=${1:-gpu-logs}; mkdir -p "$out"
GPU_T=${GPU_T:-240} SUITE_T=${SUITE_T:-330} BENCH_T=${BENCH_T:-170} PROFILE_T=${PROFILE_T:-150}
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
start=$(date +%s)
( timeout "$SUITE_T" $py -m pytest -p no:cacheprovider -m "not slow and not gpu" -n 12 \
    -v --tb=short -rfE tests > "$out/suite.log" 2>&1
  echo "exit $? after $(( $(date +%s) - start )) s (124: cut at ${SUITE_T} s)" >> "$out/suite.log" ) &
timeout "$GPU_T" $py -m pytest -q -p no:cacheprovider -m gpu --tb=short -rfE tests > "$out/gpu.log" 2>&1
echo "exit $? after $(( $(date +%s) - start )) s (124: cut at ${GPU_T} s)" >> "$out/gpu.log"
wait
if [ "$BENCH_T" -gt 0 ]; then
  bstart=$(date +%s)
  timeout "$BENCH_T" $py benchmarks/one_gpu.py --models gpt_small gpt2 llama1b --steps 10 \
    > "$out/bench.log" 2>&1
  echo "exit $? after $(( $(date +%s) - bstart )) s (124: cut at ${BENCH_T} s)" >> "$out/bench.log"
fi
[ "$PROFILE_T" -gt 0 ] || exit 0
pstart=$(date +%s)
timeout "$PROFILE_T" $py benchmarks/bf16_profile.py --models bert vit gpt_small \
  > "$out/bf16_profile.log" 2>&1
echo "exit $? after $(( $(date +%s) - pstart )) s (124: cut at ${PROFILE_T} s)" \
  >> "$out/bf16_profile.log"
