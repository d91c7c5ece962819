# Source at the start of every command on the GPU machine (carry .gpuwheels, .cache/corpus and .gitpin):
#   source scripts/gpu_env.sh && python3 -m bench stack ...
# Installs the wheels of scripts/gpu_wheels.sh into /tmp/site, makes kernels/ importable as mhc_lightning.kernels
# (an editable install did not take effect there) and points the corpus cache at the carried sdist.
# (once per machine: a second source, e.g. by a script that another sources, must not rewrite packages in use)
[ -e /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site .gpuwheels/*.whl && touch /tmp/site/.installed; } || return 1
[ -e mhc_lightning/kernels ] || ln -sfn ../kernels mhc_lightning/kernels
# The commit the runs record (scripts/gpu_pin_commit.sh): without a .git, provenance records "unknown"
git config --global --add safe.directory "$PWD"
# (the machine may hold a stale .git of an earlier commit: the pinned one replaces it)
if [ -d .gitpin/.git ]; then
  rm -rf .git && mv .gitpin/.git .git && git reset -q
  [ -s .gitpin/uncommitted.patch ] && git apply -R --binary .gitpin/uncommitted.patch
  while IFS= read -r f; do rm -f -- "$f"; done < .gitpin/untracked.txt
  [ -z "$(git status --porcelain)" ] || echo "gpu_env: the copy differs from the pinned commit: runs record it dirty"
fi
git log --oneline -1 2>/dev/null || echo "gpu_env: no .gitpin; runs record commit unknown"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 MHC_CACHE_DIR=$PWD/.cache/corpus
export PATH=/tmp/site/bin:$PATH
# The `mhc` command, where the tests that start `mhc fit` look for it (beside the interpreter: tests/test_distributed.py)
# and on PATH; the repo is not pip-installed there, so it runs the CLI module
MHC_BIN=$(python3 -c 'import os, sys; print(os.path.dirname(sys.executable))')
mkdir -p /tmp/site/bin
printf '#!/bin/sh\nexec %s/python3 -m mhc_lightning.fit.cli "$@"\n' "$MHC_BIN" > /tmp/site/bin/mhc && chmod +x /tmp/site/bin/mhc
[ -e "$MHC_BIN/mhc" ] || cp /tmp/site/bin/mhc "$MHC_BIN/mhc" 2>/dev/null || echo "gpu_env: no mhc beside $MHC_BIN/python3"
