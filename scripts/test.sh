#!/usr/bin/env bash
# Install rlx with its test extras and run the CPU test suite (what CI runs).
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export RLX_CACHE="${RLX_CACHE:-$(mktemp -d)}"  # tiny checkpoints written fresh, like a new user's
# Triton for its CPU interpreter, in a directory of its own that only the Triton kernels' tests
# put on their path (tests/unit/test_triton_interpreted.py runs tests/kernels in it); no torch comes with it
export RLX_TRITON_DIR="${RLX_TRITON_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rlx/triton-3.9.0}"
if [[ ! -d "$RLX_TRITON_DIR/triton" ]]; then
  python -m pip install -q --no-deps --target "$RLX_TRITON_DIR" triton==3.9.0 \
    || echo "warning: Triton for the interpreter did not install; tests/unit/test_triton_interpreted.py will say so" >&2
fi
# tests/integration/test_slurm.py submits jobs to a one-node SLURM on localhost (root only; the
# test itself says why it skips when SLURM cannot be started)
if [[ $(id -u) -eq 0 ]]; then
  bash scripts/slurm-local.sh || echo "warning: scripts/slurm-local.sh failed; the SLURM tests will say why" >&2
fi
# two test files at a time (most of a test's time is processes starting and waiting on each other);
# tests of one file stay together, so a module's fixtures are built once; files are handed out in
# the order tests/conftest.py sorts them (longest first), not by their number of tests
python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder "$@"
