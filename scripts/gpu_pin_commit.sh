#!/usr/bin/env bash
# Pins a GPU call to the last commit: the machine gets a copy of the working tree without .git, so without this every
# run there records commit "unknown" (or a stale checkout's). Writes .gitpin/ (ignored by git; name it in `carry`):
# a shallow, blobless clone's .git (a few hundred KB), plus what the working tree holds beyond the commit (the
# uncommitted change as a patch, the untracked files by name). scripts/gpu_env.sh installs the .git there and takes
# that change back out of the copy, so the runs record a clean commit even while work goes on here.
#   bash scripts/gpu_pin_commit.sh     # after committing, right before each GPU call
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gitpin
git config uploadpack.allowFilter true
git clone -q --depth 1 --filter=blob:none --no-checkout --no-local "file://$PWD" .gitpin
git -C .gitpin config core.fileMode false   # the copy's file modes need not survive the transfer
git diff HEAD --binary > .gitpin/uncommitted.patch
git ls-files --others --exclude-standard > .gitpin/untracked.txt
echo "pinned $(git log --oneline -1); left out of the copy: $(git diff HEAD --name-only | wc -l) changed," \
  "$(wc -l < .gitpin/untracked.txt) untracked files"
