#!/usr/bin/env bash
# Install rlx with its test extras and run the CPU test suite (what CI runs).
# Usage: bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh dev
export RLX_CACHE="${RLX_CACHE:-$(mktemp -d)}"  # tiny checkpoints written fresh, like a new user's
python -m pytest -q "$@"
