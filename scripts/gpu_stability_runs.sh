#!/usr/bin/env bash
# docs/results.md's runs in one GPU call (nvidia-h200-x2: 2 GPUs, 32 cores): the 54-run stability grid and, beside
# it, the 5 long runs at 48 sublayers bounded by LONG_TIME. The long runs get the CPU first (the small models are
# host-bound, so CPU share is step time); both grids write one MLflow store, returned under $OUT.
#   OUT=out LONG_TIME=00:00:07:00 bash scripts/gpu_stability_runs.sh
# LONG_ONLY=1: the 5 long runs alone, with the machine to themselves (the 2026-11-30 runs shared it with the grid
# and stopped at 1112-2609 of their 3000 steps), e.g. OUT=out LONG_ONLY=1 LONG_TIME=00:00:09:00 LIMIT=570.
set -u
OUT=${OUT:-out}; LONG_TIME=${LONG_TIME:-00:00:07:00}; LIMIT=${LIMIT:-510}
mkdir -p "$OUT"
source scripts/gpu_env.sh || exit 1
export OMP_NUM_THREADS=1
source scripts/gpu_tracking.sh
long_grid() {
  timeout $LIMIT python3 -m mhc_lightning.grids.cli conf/experiments/stability_long_grid.yaml --parallel 5 \
    --logs $store/logs_long --set trainer.max_time=$LONG_TIME
}
pack() {  # the store and the logs of what ran, under $OUT
  sleep 2
  gzip -c $store/mlflow.db > $OUT/mlflow.db.gz
  tar czf $OUT/artifacts_and_logs.tgz --exclude="*.png" -C $store artifacts "$@" server.log
  ls -la $OUT
}
if [ "${LONG_ONLY:-0}" = 1 ]; then
  long_grid 2>&1 | tee $OUT/grid_long.log
  pack logs_long
  exit 0
fi
long_grid > $OUT/grid_long.log 2>&1 &
long=$!
sleep 5   # the long grid creates its experiment and starts first
timeout $LIMIT nice -n 10 python3 -m mhc_lightning.grids.cli conf/experiments/stability_grid.yaml --parallel 27 \
  --logs $store/logs 2>&1 | tee $OUT/grid.log
wait $long; cat $OUT/grid_long.log
pack logs logs_long
