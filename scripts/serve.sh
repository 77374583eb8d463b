#!/usr/bin/env bash
# Serves a model with vLLM's OpenAI-compatible server on the Spyre backend:
# `make serve`, and the container's default command (Dockerfile.spyre).
#
#   MODEL            Hugging Face folder   (models/SmolLM2-135M-Instruct)
#   HOST, PORT       where to listen       (127.0.0.1, 8000)
#   VLLM_SERVE_ARGS  more `vllm serve` arguments, split on spaces
#
# Arguments are passed on to `vllm serve`.  Without Spyre settings in the
# environment, warm-up is kept short: one shape of 128 prompt tokens, 64 new
# tokens, batch 4, and the eager backend unless torch_sendnn is installed
# (docs/configuration.md has them all).
set -euo pipefail
cd "$(dirname "$0")/.."

export VLLM_USE_V1=${VLLM_USE_V1:-0}
export VLLM_RPC_TIMEOUT=${VLLM_RPC_TIMEOUT:-3000}
if [ "${VLLM_SPYRE_USE_CB:-0}" != 1 ]; then
  export VLLM_SPYRE_WARMUP_PROMPT_LENS=${VLLM_SPYRE_WARMUP_PROMPT_LENS:-128}
  export VLLM_SPYRE_WARMUP_NEW_TOKENS=${VLLM_SPYRE_WARMUP_NEW_TOKENS:-64}
  export VLLM_SPYRE_WARMUP_BATCH_SIZES=${VLLM_SPYRE_WARMUP_BATCH_SIZES:-4}
fi
# On the CPU, eager starts fastest; with torch_sendnn (real cards) the
# platform's own default, sendnn, applies.
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch_sendnn") is None)'; then
  export VLLM_SPYRE_DYNAMO_BACKEND=${VLLM_SPYRE_DYNAMO_BACKEND:-eager}
fi

# shellcheck disable=SC2086  # VLLM_SERVE_ARGS is a list of arguments
exec .venv/bin/vllm serve "${MODEL:-models/SmolLM2-135M-Instruct}" \
  --host "${HOST:-127.0.0.1}" --port "${PORT:-8000}" \
  ${VLLM_SERVE_ARGS:-} "$@"
