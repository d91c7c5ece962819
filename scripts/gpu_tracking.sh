# Source after scripts/gpu_env.sh: an MLflow server for the runs of one GPU call, its store under $store, and the
# machine's GPU and versions in $OUT/gpu.txt. SEED_DB: the store of an earlier part, to continue it.
store=${store:-/tmp/stability}; mkdir -p "$store"
[ -n "${SEED_DB:-}" ] && cp "$SEED_DB" "$store/mlflow.db"
python3 -m mlflow server --backend-store-uri "sqlite:///$store/mlflow.db" --artifacts-destination "$store/artifacts" \
  --serve-artifacts --host 127.0.0.1 --port 5055 --workers 4 > "$store/server.log" 2>&1 &
server=$!; trap 'kill $server 2>/dev/null' EXIT
for _ in $(seq 60); do python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:5055/health')" 2>/dev/null && break; sleep 1; done
export MLFLOW_TRACKING_URI=http://127.0.0.1:5055
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__)" | tee -a "$OUT/gpu.txt"
