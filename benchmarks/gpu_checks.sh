#!/usr/bin/env bash
# Every GPU check in one go, for a one-GPU machine prepared as ../shared/tools/gpu_wheels.sh
# says (its image's own torch; PuLP and highspy from .whl/). Logs go to $1 (default gpu-logs/):
#   env.txt     the device, driver and package versions
#   gpu.log     make test-gpu (tests marked gpu: the zoo trains on CUDA like eager)
#   suite.log   the rest of the suite (not slow) on the same machine, GPU visible, run
#               beside gpu.log (multi-rank tests stay on gloo/CPU; JAX kept on the CPU)
#   bench.log   benchmarks/one_gpu.py, alone on the machine once the tests are done: every
#               zoo model, fp32 and bf16, eager and torchalpa, measured beside the plan's
#               estimate (issue 37: within 15% step, 10% memory), a process per variant
#   ops.log     benchmarks/op_times.py: GPT-2 small bf16, each op timed alone beside its price
#               on the datasheet model (where the step estimate is off, by op family)
#   bf16_profile.log  benchmarks/bf16_profile.py: where a bf16 step's time goes, eager
#               autocast vs torchalpa (host issue, GPU kernel time, syncs, top kernels)
#   calib.log   torchalpa calibrate: the device's matmul/bandwidth/op/attention rates, stored
#               for the planner; then one_gpu.py's GPT-2 and LLaMA rows planned with them
# Each part has its own time limit (seconds: GPU_T, SUITE_T, BENCH_T, OPS_T, PROFILE_T, CALIB_T) so the
# whole fits a lease; a part cut short says so in its log (0 skips a part). The suite's
# log names each test as it ends (-v), so a run cut short still says what failed.
set -u
out=${1:-gpu-logs}; mkdir -p "$out"
GPU_T=${GPU_T:-240} SUITE_T=${SUITE_T:-330} BENCH_T=${BENCH_T:-360}
OPS_T=${OPS_T:-90} PROFILE_T=${PROFILE_T:-150} CALIB_T=${CALIB_T:-150}
# the defaults add up to more than one 600-s command: set some parts to 0 and run the
# rest in a second call
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
part() {  # name limit command...: run it alone, log how it ended
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt 0 ] || return 0
  local t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  echo "exit $? after $(( $(date +%s) - t0 )) s (124: cut at $limit s)" >> "$out/$name.log"
}
part bench "$BENCH_T" $py benchmarks/one_gpu.py --steps 10 --no-compile \
  --variants eager torchalpa --models gpt2 llama1b gpt_small bert vit resnet moe
part ops "$OPS_T" env PYTHONPATH="benchmarks${PYTHONPATH:+:$PYTHONPATH}" \
  $py benchmarks/op_times.py --model gpt2 --dtype bf16 --cluster h200
part bf16_profile "$PROFILE_T" $py benchmarks/bf16_profile.py --models bert vit gpt_small
part calib "$CALIB_T" sh -c "$py -m torchalpa.cli.commands calibrate && \
  $py benchmarks/one_gpu.py --steps 10 --no-compile --variants torchalpa --models gpt2 llama1b"
