"""The Spyre settings (environment variables) of each backend and mode,
as the tests and the benchmarks select them."""
from __future__ import annotations

from typing import Sequence

#: The backend label of the pure torch-op path: ``eager`` with
#: ``VLLM_SPYRE_NATIVE_KERNELS=0``.
TORCH_OPS = "eager-torch-ops"

#: Spyre warm-up prompt lengths are multiples of 64.
PROMPT_LEN_MULTIPLE = 64


def backend_env(label: str) -> dict[str, str]:
    """The settings of a backend label: ``eager`` or ``inductor`` (on the
    C++ kernels where they build), or ``TORCH_OPS``."""
    if label == TORCH_OPS:
        return {"VLLM_SPYRE_DYNAMO_BACKEND": "eager",
                "VLLM_SPYRE_NATIVE_KERNELS": "0"}
    return {"VLLM_SPYRE_DYNAMO_BACKEND": label,
            "VLLM_SPYRE_NATIVE_KERNELS": "1"}


def _join(values) -> str:
    return ",".join(str(v) for v in values)


def spyre_env(backend: str, prompt_lens: Sequence[int],
              new_tokens: Sequence[int],
              batch_sizes: Sequence[int]) -> dict[str, str]:
    """Static batching on ``backend`` with the warm-up shapes given as
    three parallel lists."""
    return {
        **backend_env(backend),
        "VLLM_SPYRE_WARMUP_PROMPT_LENS": _join(prompt_lens),
        "VLLM_SPYRE_WARMUP_NEW_TOKENS": _join(new_tokens),
        "VLLM_SPYRE_WARMUP_BATCH_SIZES": _join(batch_sizes),
    }


def padded_prompt_len(prompt_len: int) -> int:
    """The Spyre warm-up prompt length holding ``prompt_len`` tokens."""
    return -(-prompt_len // PROMPT_LEN_MULTIPLE) * PROMPT_LEN_MULTIPLE


def warmup_env(backend: str,
               shapes: Sequence[tuple[int, int, int]]) -> dict[str, str]:
    """Static batching on ``backend`` with warm-up shapes given as
    ``(prompt_len, new_tokens, batch_size)``; prompt lengths are rounded up
    to the Spyre multiple of 64."""
    shapes = [(padded_prompt_len(p), g, b) for p, g, b in shapes]
    return spyre_env(backend, *zip(*shapes))


def cb_env(backend: str) -> dict[str, str]:
    """Continuous batching on ``backend``."""
    return {**backend_env(backend), "VLLM_SPYRE_USE_CB": "1"}


def cb_max_model_len(prompt_len: int, new_tokens: int) -> int:
    """``--max-model-len`` of a continuous-batching engine for prompts of
    ``prompt_len`` tokens and ``new_tokens`` outputs: their sum, rounded up
    to whole 64-token blocks."""
    return padded_prompt_len(prompt_len + new_tokens)
