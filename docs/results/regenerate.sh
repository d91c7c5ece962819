#!/usr/bin/env bash
# Regenerates docs/results.md, docs/results/{amax_vs_mhc,init_study,long_runs,replicates}.md with `mhc compare` from the
# committed MLflow stores (SQLite, gzipped) and their per-layer diagnostics artifacts, served by a local mlflow server
# (the stores' artifact URIs are mlflow-artifacts:/..., as on the GPU machine that wrote them).
#   bash docs/results/regenerate.sh            # from the repository root, with the venv of README's first command
# The runs themselves: scripts/gpu_stability_grid.sh (init study, replicates) and scripts/gpu_stability_runs.sh (grid +
# long runs).
set -euo pipefail
cd "$(dirname "$0")/../.."
bin=${VENV_BIN:-$PWD/.venv/bin}
tmp=$(mktemp -d)
server=""
trap '[ -n "$server" ] && kill $server 2>/dev/null; rm -rf "$tmp"' EXIT

serve() {  # serve <store name> <port>: unpack docs/results/<name>_{mlflow.db.gz,artifacts.tgz}, start a server
  mkdir -p "$tmp/$1"
  gunzip -c "docs/results/$1_mlflow.db.gz" > "$tmp/$1/mlflow.db"
  [ ! -e "docs/results/$1_artifacts.tgz" ] || tar xzf "docs/results/$1_artifacts.tgz" -C "$tmp/$1"  # per-layer JSON
  "$bin/mlflow" server --backend-store-uri "sqlite:///$tmp/$1/mlflow.db" --artifacts-destination "$tmp/$1/artifacts" \
    --serve-artifacts --host 127.0.0.1 --port "$2" --workers 1 > "$tmp/$1/server.log" 2>&1 &
  server=$!
  for _ in $(seq 120); do "$bin/python" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$2/health')" \
    2>/dev/null && return 0; sleep 1; done
  echo "mlflow server for $1 did not start: $tmp/$1/server.log" >&2; return 1
}

serve stability 5077
"$bin/mhc" compare --experiment stability --group-by variant,model.arch.n_layers --baseline residual \
  --tracking-uri http://127.0.0.1:5077 --out docs/results --report docs/results.md --notes docs/results_notes.md --context docs/results/context.txt
"$bin/mhc" compare --experiment stability --group-by variant,model.arch.n_layers --baseline mhc --metric amax_bwd_peak \
  --tracking-uri http://127.0.0.1:5077 --out docs/results/amax_vs_mhc --report docs/results/amax_vs_mhc.md \
  --context docs/results/context.txt
"$bin/mhc" compare --experiment stability-long --group-by variant,model.arch.n_layers \
  --tracking-uri http://127.0.0.1:5077 --out docs/results/long_runs --report docs/results/long_runs.md \
  --context docs/results/context.txt
kill $server; wait $server 2>/dev/null || true; server=""

serve init_study 5078
"$bin/mhc" compare --experiment init-study --group-by variant,model.arch.n_layers --baseline mhc_zeros \
  --tracking-uri http://127.0.0.1:5078 --out docs/results/init_study --report docs/results/init_study.md --context docs/results/init_study_context.txt
kill $server; wait $server 2>/dev/null || true; server=""

serve replicates 5079
"$bin/mhc" compare --experiment replicates --group-by variant,trainer.deterministic \
  --tracking-uri http://127.0.0.1:5079 --out docs/results/replicates --report docs/results/replicates.md \
  --context docs/results/replicates_context.txt
