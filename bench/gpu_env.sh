# Source at the start of every command on the GPU machine (carry .gpuwheels and .cache/corpus):
#   source bench/gpu_env.sh && python3 bench/bench_mhc.py ...
# Installs the wheels of bench/gpu_wheels.sh into /tmp/site, makes kernels/ importable as mhc_lightning.kernels
# (an editable install did not take effect there) and points the corpus cache at the carried sdist.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuwheels/*.whl \
  || return 1
[ -e mhc_lightning/kernels ] || ln -sfn ../kernels mhc_lightning/kernels
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 MHC_CACHE_DIR=$PWD/.cache/corpus
export PATH=/tmp/site/bin:$PATH
