"""What a block pool can hold, under continuous batching.

Continuous batching keeps every sequence's keys and values in blocks of
``block_size`` tokens, handed out by vLLM's block manager from one pool.
The scheduler (``SpyreCBScheduler``) refuses, up front, a request that
could never run (``rejection_reason``, ``parallel_samples_reason``); the
worker sizes the pool and the runner builds block tables with the same
``blocks_needed``.  Nothing here touches a model, a scheduler or a tensor.

The module sits beside the schedulers but at the bottom of the project's
layers, above the settings only: the workers read it as well.
"""
from __future__ import annotations

from typing import Optional


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def rejection_reason(prompt_len: int, max_tokens: int, max_model_len: int,
                     block_size: int, usable_blocks: int) -> Optional[str]:
    """Why a request can never run under continuous batching, or None."""
    total = prompt_len + max_tokens
    if total > max_model_len:
        return (f"The request needs {total} tokens (prompt length "
                f"{prompt_len} + max_tokens {max_tokens}), more than "
                f"max_model_len={max_model_len}. Shorten the prompt or "
                "lower max_tokens, or raise --max-model-len.")
    need = blocks_needed(total, block_size)
    if need > usable_blocks:
        return (f"The request needs {need} key/value blocks of {block_size} "
                f"tokens (prompt length {prompt_len} + max_tokens "
                f"{max_tokens}), more than the {usable_blocks} usable blocks "
                "of the whole pool. Shorten the prompt or lower max_tokens, "
                "or raise --num-gpu-blocks-override or "
                "--gpu-memory-utilization.")
    return None


def parallel_samples_reason(n: int, prompt_len: int, max_tokens: int,
                            max_num_seqs: int, block_size: int,
                            usable_blocks: int) -> Optional[str]:
    """Why the ``n`` samples of one request (``n`` or ``best_of``) can never
    run side by side under continuous batching, or None."""
    if n > max_num_seqs:
        return (f"n={n} parallel samples of one request are more than "
                f"--max-num-seqs={max_num_seqs}, the most sequences that "
                "decode at once. Lower n (or best_of), or raise "
                "--max-num-seqs.")
    need = n * blocks_needed(prompt_len + max_tokens, block_size)
    if need > usable_blocks:
        return (f"n={n} parallel samples of {prompt_len} + {max_tokens} "
                f"tokens need {need} key/value blocks of {block_size} "
                f"tokens, more than the {usable_blocks} usable blocks of the "
                "whole pool. Lower n (or best_of), shorten the prompt or "
                "lower max_tokens, or raise --num-gpu-blocks-override or "
                "--gpu-memory-utilization.")
    return None
