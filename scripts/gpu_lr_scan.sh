#!/usr/bin/env bash
# One part of issue 60's GPU work on a GPU machine: a grid that continues the store of the part before it.
# The store is committed, docs/results/lr_scan_mlflow.db.gz, so that any session continues it; it comes back as
# $OUT/mlflow.db.gz: copy that over the committed one (and commit) before the next part. Carry .gpuwheels,
# .cache/corpus and .gitpin (scripts/gpu_env.sh).
# KERNEL_TESTS=1 runs the kernel test tree on CUDA first, alone (beside 14 fits both run out of GPU memory), and gives
# the grid what is left of LIMIT.
#
# The plan, each step one device call (here: bash scripts/gpu_wheels.sh once, bash scripts/gpu_pin_commit.sh before
# every call; carry [".gpuwheels", ".cache/corpus", ".gitpin"]):
#   1. the scan at 48 sublayers, 7 variants x 6 lr x seeds 1, 2 (84 runs), as many calls as it takes:
#        LIMIT=450 PARALLEL=14 bash scripts/gpu_lr_scan.sh
#      then here: cp /work/.device/N/mlflow.db.gz docs/results/lr_scan_mlflow.db.gz
#   2. once every variant has a best lr (here):
#        python scripts/lr_confirm_grid.py sqlite:///<the unzipped store> > conf/experiments/lr_confirm_grid.yaml
#      commit it, pin, and run 8 fresh seeds at each variant's best lr (56 runs), as many calls as it takes:
#        GRID=conf/experiments/lr_confirm_grid.yaml LIMIT=450 PARALLEL=14 bash scripts/gpu_lr_scan.sh
#   3. here: docs/results/regenerate.sh gains the two reports
#        mhc report --experiment lr-scan --group-by variant,model.optim.lr
#        mhc report --experiment lr-confirm --group-by variant --baseline residual
set -u
OUT=${OUT:-out}; GRID=${GRID:-conf/experiments/lr_scan_deep_grid.yaml}
mkdir -p "$OUT"
STORE=${STORE:-docs/results/lr_scan_mlflow.db.gz}
if [ -s "$STORE" ]; then gunzip -c "$STORE" > /tmp/seed.db && export SEED_DB=/tmp/seed.db; fi
source scripts/gpu_env.sh || exit 1
if [ "${KERNEL_TESTS:-0}" = 1 ]; then
  t0=$SECONDS
  timeout "${TESTS_LIMIT:-240}" python3 -m pytest -q tests/test_kernels_*.py tests/test_recompute.py tests/test_model.py \
    -n 8 -p no:cacheprovider > "$OUT/tests.log" 2>&1
  timeout 90 python3 -m pytest -q -m gpu tests -n 4 -p no:cacheprovider >> "$OUT/tests.log" 2>&1
  grep -E "passed|failed|error" "$OUT/tests.log" | tail -4
  export LIMIT=$(( ${LIMIT:-480} - (SECONDS - t0) ))
fi
# a run starts only if runs of its variant end before the limit: across sessions a half-done run is lost work
SKIP_DIAG_BENCH=1 GRID=$GRID bash scripts/gpu_stability_grid.sh --skip-finished --finish-within $(( ${LIMIT:-480} - 40 ))
