#!/usr/bin/env bash
# Install rlx and its dependencies on a fresh CPU machine (torch pinned first: it must never
# resolve to another build). Usage: bash scripts/install.sh [extras], e.g. `bash scripts/install.sh dev`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${1:+[$1]}" torch==2.13.0
