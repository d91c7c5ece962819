#!/usr/bin/env bash
# One full performance call on the GPU machine (issue 13's protocol, docs/benchmarks.md): the kernel tests, the stack
# benchmark in one process (eager, CUDA graphs, the per-sublayer compile, Liger), and the trainer rows. Each step has
# its own time limit, so a hang (the chained stack under torch.compile: docs/benchmarks.md, round 4) costs its
# limit and not the call; everything lands under $OUT. Carry .gpuwheels (bench/gpu_wheels.sh).
#   run: OUT=$OUT bash bench/gpu_perf_round.sh            (about 8 minutes on an H200)
#   PROFILE=1: --quick --sweep --profile --profile-host instead of the full table (launch-config sweep, CUDA time per
#   kernel, host time per Python function: the eager step waits on the host on slow machines), and the trainer rows
#   with `bench_ddp.py --profile 3` (kernel time against wall time per step, one more run per mode), and
#   bench/trainer_traffic.py's table of each fused kernel's share of copy bandwidth in that step.
#   TRAINER_ARGS: more bench_ddp.py arguments for the trainer rows, e.g.
#   TRAINER_ARGS="--repeat 2 --kernel-config 'tf32={\"coef_fwd\":{\"phi_split\":false}}'" (an A/B in one call).
#   NCU=1: first, Nsight Compute on the slowest kernels (occupancy, stall reasons, memory throughput; about a minute),
#   one op body each (`bench_mhc.py --phi-dtype fp32 --only-op`: the trainer's fp32 phi), reports under $OUT/ncu.
#   STACK_VARIANTS: the stack table's variants (bench_mhc.py --variants; default ours,cudagraph,hc,liger).
#   TESTS=0: skip the kernel tests (code the GPU tests already passed). CHAIN=0: skip the chained trainer row.
#   TRAINER_COMPILE=1: also the trainer rows with `model.compile: true` (residual and mHC; about two minutes; with
#   PROFILE=1 or TRAINER_ARGS, the same extra arguments as the eager rows). TRAINER_COMPILE_MODE: their
#   model.compile_mode (default "default"; "reduce-overhead": CUDA graphs, round 13).
#   HOST=1: also the host's side of the compiled step (`bench_host.py --real`): both compiled models' forwards with
#   mHC's extra functions, and each fused op as the compiled graph calls it against its body (round 35; ~2 minutes).
set -u
OUT=${OUT:-out}
mkdir -p "$OUT/trainer" "$OUT/trainer_chain" "$OUT/compile" "$OUT/phi_fp32"
source bench/gpu_env.sh > "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 1; }

if [ "${NCU:-0}" = 1 ]; then
  echo "== ncu"
  mkdir -p "$OUT/ncu"
  ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for k in "_post_bwd_2d:2-D pass" "_coef_fwd:mhc_pre fwd" "_coef_bwd_x:mhc_pre bwd" "_coef_bwd_tok:per token"; do
    timeout 120 "$ncu" --kernel-name "regex:${k%%:*}" --launch-skip 5 --launch-count 1 --section SpeedOfLight \
      --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
      python3 bench/bench_mhc.py --phi-dtype fp32 --only-op "${k#*:}" > "$OUT/ncu/${k%%:*}.txt" 2>&1
    grep -E "Duration|DRAM Throughput|Registers Per|Achieved Occupancy" "$OUT/ncu/${k%%:*}.txt" | sed "s/^/${k%%:*} /"
  done
fi

if [ "${TESTS:-1}" = 1 ]; then
  echo "== kernel tests"
  timeout 200 python3 -m pytest -q -x tests/test_kernels.py tests/test_recompute.py -n 8 -p no:cacheprovider 2>&1 \
    | tail -3 | tee "$OUT/tests.log"
fi

echo "== stack benchmark"
if [ "${PROFILE:-0}" = 1 ]; then
  bench_args=(--quick --sweep --profile --profile-host)
else
  bench_args=(--no-kernels --variants "${STACK_VARIANTS:-ours,cudagraph,hc,liger}" --skip "compile,recompute")
fi
timeout 230 python3 bench/bench_mhc.py --shapes 1,2 --iters 10 --warmup 2 --budget-s 200 "${bench_args[@]}" \
  --out "$OUT" > "$OUT/bench_mhc.log" 2>&1
grep -A30 "ms/step" "$OUT/bench_mhc.log"

echo "== kernel table and stack with phi in fp32 (what the trainer holds under bf16-mixed)"
timeout 100 python3 bench/bench_mhc.py --quick --shapes 1 --iters 8 --warmup 2 --phi-dtype fp32 --out "$OUT/phi_fp32" \
  > "$OUT/phi_fp32/bench_mhc.log" 2>&1
grep -A18 "ms/step" "$OUT/phi_fp32/bench_mhc.log" | grep -v "^checks"

echo "== compiled, one sublayer at a time"
timeout 120 python3 bench/bench_mhc.py --shapes 1 --iters 5 --warmup 1 --no-kernels \
  --variants "residual+compile,per-sublayer ops)+compile" --skip recompute --out "$OUT/compile" \
  > "$OUT/compile/bench_mhc.log" 2>&1
grep -A5 "ms/step" "$OUT/compile/bench_mhc.log"

echo "== trainer (bench_ddp --gpus 1): residual, mHC and HC, then the chained mHC"
trainer_args=()
[ "${PROFILE:-0}" = 1 ] && trainer_args+=(--profile 3)
eval "trainer_args+=(${TRAINER_ARGS:-})"
timeout 240 python3 bench/bench_ddp.py --gpus 1 --no-check --modes residual,mhc,hc --timeout 110 --out "$OUT/trainer" \
  "${trainer_args[@]}" 2>&1 | grep -E "^\| |kernels|exit [^0]" | tail -12
if [ "${PROFILE:-0}" = 1 ]; then  # each fused kernel's share of copy bandwidth in the profiled trainer step
  bw=$(python3 -c "import json; print(json.load(open('$OUT/bench_mhc.json'))['info']['copy_tb_s'])")
  python3 bench/trainer_traffic.py "$OUT/trainer/bench_ddp.json" --copy-tbps "$bw" --out "$OUT/trainer/traffic.json"
fi
if [ "${CHAIN:-1}" = 1 ]; then
  timeout 80 python3 bench/bench_ddp.py --gpus 1 --no-check --modes mhc --timeout 70 \
    --fit-args=--model.arch.hyper.chain_sublayers=true --out "$OUT/trainer_chain" 2>&1 | tail -3
fi
if [ "${TRAINER_COMPILE:-0}" = 1 ]; then
  echo "== trainer, compiled (model.compile: true)"
  mkdir -p "$OUT/trainer_compile"
  timeout 300 python3 bench/bench_ddp.py --gpus 1 --no-check --modes residual,mhc --timeout 140 \
    --fit-args="--model.compile=true --model.compile_mode=${TRAINER_COMPILE_MODE:-default}" \
    --out "$OUT/trainer_compile" "${trainer_args[@]}" 2>&1 \
    | grep -E "^\| |kernels|exit [^0]" | tail -8
fi

if [ "${HOST:-0}" = 1 ]; then
  echo "== host time: the compiled forwards, the fused ops as custom ops against their bodies"
  mkdir -p "$OUT/host"
  timeout 240 python3 bench/bench_host.py --real --model --compile --steps 20 --top 20 \
    --out "$OUT/host/model_compiled.json" 2>&1 | tail -23
  timeout 120 python3 bench/bench_host.py --real --dispatch --steps 30 --out "$OUT/host/dispatch.json" 2>&1 | tail -5
fi

# The device returns at most 8 files: the sub-runs' JSON and logs travel as one archive (tar xzf round.tgz)
subdirs=$(cd "$OUT" && ls -d trainer trainer_chain trainer_compile compile phi_fp32 ncu host 2>/dev/null)
tar czf "$OUT/round.tgz" -C "$OUT" $subdirs && (cd "$OUT" && rm -r $subdirs)
ls "$OUT"
