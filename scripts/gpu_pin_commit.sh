#!/usr/bin/env bash
# The commit a GPU call runs, carried as a shallow clone's .git in .gitpin/ (ignored by git; name it in `carry`):
# the machine gets a copy of the working tree without .git, so without this every run there records commit
# "unknown". scripts/gpu_env.sh moves it into place; git then reports the commit and whether the copy differs.
#   bash scripts/gpu_pin_commit.sh     # after committing, before each GPU call
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "$(git status --porcelain)" ]; then
  echo "gpu_pin_commit: the tree has uncommitted changes; commit first (runs must come from committed code)" >&2
  exit 1
fi
rm -rf .gitpin
# commits and trees without file contents (a few hundred KB): git status there compares the copy's files by hash
git config uploadpack.allowFilter true
git clone -q --depth 1 --filter=blob:none --no-checkout --no-local "file://$PWD" .gitpin
git -C .gitpin config core.fileMode false   # the copy's file modes need not survive the transfer
git -C .gitpin log --oneline -1
