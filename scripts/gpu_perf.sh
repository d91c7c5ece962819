#!/usr/bin/env bash
# The GPU protocol in one call on a GPU machine (docs/benchmarks.md): the GPU tests first, then the benchmarks. Each
# step has its own time limit, so a hang costs its limit and not the call. Carry .gpuwheels (scripts/gpu_wheels.sh)
# and .gitpin (scripts/gpu_pin_commit.sh, right before the call: the JSONs then record the commit).
#   OUT=$OUT bash scripts/gpu_perf.sh                    (about 10 minutes on an H200)
# Every JSON and log lands in $OUT/perf, returned as one archive ($OUT/perf.tgz: tar xzf perf.tgz), beside
# $OUT/tests.log. Switches:
#   TESTS=0        skip the GPU tests (code that already passed them)
#   PROFILE=1      the stack and the eager trainer rows profiled (device time per kernel, the GPU waiting on the
#                  host), and each fused kernel of the trainer's step against copy bandwidth (python -m bench traffic)
#   COMPILE=0      skip the compiled trainer rows; COMPILE_MODE: their model.compile_mode (default "default";
#                  "reduce-overhead": CUDA graphs)
#   TRAINER_ARGS   more `python -m bench trainer` arguments for every trainer row, e.g.
#                  TRAINER_ARGS="--repeat 2 --kernel-config 'wide={\"coef_fwd\":{\"BT\":128}}'" (an A/B in one call)
#   HOST=1         the host's side of the compiled step (python -m bench host --model --compile)
#   RESOURCES=1    registers, spills and shared memory of every fused kernel (python -m bench resources)
#   NCU=1          Nsight Compute on the fused kernels of one stack step (occupancy, stalls, memory throughput)
set -u
OUT=${OUT:-out}
P="$OUT/perf"
mkdir -p "$P"
source scripts/gpu_env.sh > "$P/setup.log" 2>&1 || { tail "$P/setup.log"; exit 1; }
python3 -c "import torch, triton, lightning; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton',
triton.__version__, 'lightning', lightning.__version__)" | tee "$P/versions.txt"

if [ "${TESTS:-1}" = 1 ]; then
  # the kernel, recompute and model tests run on CUDA where it exists; -m gpu adds the CUDA-only ones elsewhere
  echo "== GPU tests (the kernel tree on CUDA, and pytest -m gpu)"
  timeout 300 python3 -m pytest -q -x tests/test_kernels_*.py tests/test_recompute.py tests/test_model.py -n 8 \
    -p no:cacheprovider > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log"
  timeout 200 python3 -m pytest -q -x -m gpu tests -n 8 -p no:cacheprovider > "$OUT/tests_gpu_only.log" 2>&1
  tail -3 "$OUT/tests_gpu_only.log"
fi

echo "== stack"
stack_args=()
[ "${PROFILE:-0}" = 1 ] && stack_args+=(--profile)
timeout 260 python3 -m bench stack --shapes 1024,2048 --iters 10 --warmup 2 --budget-s 220 \
  --skip "compile,recompute,reference,lucidrains" "${stack_args[@]}" --out "$P/stack.json" > "$P/stack.log" 2>&1
grep -A40 "ms/step" "$P/stack.log"

echo "== trainer, eager: residual, mHC and HC"
trainer_args=()
[ "${PROFILE:-0}" = 1 ] && trainer_args+=(--profile 3)
eval "trainer_args+=(${TRAINER_ARGS:-})"
timeout 300 python3 -m bench trainer --modes residual,mhc,hc --steps 30 --timeout 110 --out "$P/trainer.json" \
  "${trainer_args[@]}" > "$P/trainer.log" 2>&1
grep -A8 "^variant" "$P/trainer.log"
if [ "${PROFILE:-0}" = 1 ]; then
  bw=$(python3 -c "import json; print(json.load(open('$P/stack.json'))['env']['copy_tb_s'])")
  python3 -m bench traffic "$P/trainer.json" --copy-tbps "$bw" --out "$P/traffic.json" | tee "$P/traffic.log"
fi

if [ "${COMPILE:-1}" = 1 ]; then
  echo "== trainer, compiled (model.compile: true, mode ${COMPILE_MODE:-default})"
  timeout 360 python3 -m bench trainer --modes residual,mhc,hc --steps 30 --timeout 150 \
    --fit-args="--model.compile=true --model.compile_mode=${COMPILE_MODE:-default}" \
    --out "$P/trainer_compiled.json" "${trainer_args[@]}" > "$P/trainer_compiled.log" 2>&1
  grep -A8 "^variant" "$P/trainer_compiled.log"
fi

if [ "${HOST:-0}" = 1 ]; then
  echo "== host: the compiled forwards and mHC's extra host time by function"
  timeout 240 python3 -m bench host --model --compile --steps 20 --top 20 --out "$P/host.json" > "$P/host.log" 2>&1
  tail -25 "$P/host.log"
fi

if [ "${RESOURCES:-0}" = 1 ]; then
  echo "== resources"
  timeout 240 python3 -m bench resources --out "$P/resources.json" > "$P/resources.log" 2>&1
  tail -40 "$P/resources.log"
fi

if [ "${NCU:-0}" = 1 ]; then
  echo "== ncu"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for k in _post_bwd_2d _coef_fwd _coef_bwd_x _coef_bwd_tok; do
    timeout 150 "$ncu" --kernel-name "regex:$k" --launch-skip 5 --launch-count 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
      python3 -m bench stack --shapes 1024 --variants "mhc chained" --iters 1 --warmup 1 --out "$P/ncu_stack.json" \
      > "$P/ncu_$k.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$P/ncu_$k.txt" | sed "s/^/$k /"
  done
fi

# the device returns at most 8 files: everything under $P travels as one archive
tar czf "$OUT/perf.tgz" -C "$OUT" perf && rm -r "$P"
ls "$OUT"
