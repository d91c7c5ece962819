#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, no network; torch, triton, lightning and torchmetrics already there).
# Run here, with network, once per session; every GPU command then installs them with scripts/gpu_env.sh.
#   bash scripts/gpu_wheels.sh            # -> .gpuwheels/ (ignored by git; name it in `carry`)
# What the image already holds (its package list, 2026-11-17) is left out: a second numpy or pandas on the
# path would shadow the image's builds of them.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.gpuwheels
rm -rf "$dest" && mkdir -p "$dest"
pip=${PIP:-python3 -m pip}
$pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dest" \
  "mlflow==3.17.2" "jsonargparse[signatures,omegaconf]==4.53.0" "omegaconf==2.4.0" \
  "optuna==5.0.0" "optuna-integration==5.0.0" 2>&1 | grep -v "^WARNING" || true
# torchdata (the stateful train loader) and the peers of `python -m bench stack`, without their needs: those are on the
# image, torch among them (asked for with its needs, pip would fetch a CUDA torch of several GB)
$pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform any \
  -d "$dest" "torchdata==0.11.0" "liger-kernel==0.8.5" "hyper-connections==0.4.11" 2>&1 | grep -v "^WARNING" || true
on_image="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cycler cython einops
filelock fonttools frozenlist fsspec h11 h5py httpcore httpx huggingface-hub idna imageio iniconfig jinja2
joblib kiwisolver lightning lightning-utilities markdown markdown-it-py markupsafe matplotlib mdurl ml-dtypes
mpmath msgpack multidict narwhals networkx numpy packaging pandas pillow pip pluggy prometheus-client
propcache protobuf psutil pyarrow pygments pyparsing python-dateutil pytorch-lightning pyyaml regex requests
rich safetensors scikit-learn scipy setuptools six sortedcontainers sympy tabulate threadpoolctl tqdm torch
torchmetrics triton typing-extensions typing-inspect urllib3 werkzeug wheel wrapt yarl zipp"
for w in "$dest"/*.whl; do
  name=$(basename "$w" | cut -d- -f1 | tr '_A-Z' '-a-z')
  for have in $on_image; do [ "$name" = "$have" ] && rm "$w" && break; done
done
ls "$dest" | wc -l; du -sh "$dest"
