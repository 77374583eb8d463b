"""Which requests fit which compiled shapes, under static batching.

Spyre runs only graphs compiled at start-up, one set per warm-up shape
``(prompt_len, new_tokens, batch_size)``.  These rules are shared by both
sides of a step: the scheduler (``SpyreStaticScheduler``) refuses a request
that fits no shape (``rejection_reason``, ``parallel_samples_reason``) and
picks the next batch from its waiting queue (``select_batch``); the model
runner finds the same shape again from the batch it receives
(``choose_shape``).
Every function takes plain values; nothing here touches a model, a
scheduler or a tensor.

The module sits beside the schedulers but at the bottom of the project's
layers, above the settings only: the workers read it as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from vllm.config.spyre import WarmupShape


@dataclass(frozen=True)
class RequestSize:
    """What the scheduler needs to know of a request to place it."""

    prompt_len: int
    max_tokens: int


def fits(shape: WarmupShape, req: RequestSize) -> bool:
    """True if one request fits one row of ``shape``."""
    return (req.prompt_len <= shape.prompt_len
            and req.max_tokens <= shape.new_tokens)


def choose_shape(reqs: Sequence[RequestSize],
                 shapes: Sequence[WarmupShape]) -> Optional[WarmupShape]:
    """The cheapest shape that holds every request of ``reqs`` at once."""
    candidates = [
        s for s in shapes
        if len(reqs) <= s.batch_size and all(fits(s, r) for r in reqs)
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda s: s.cost)


def select_batch(
    waiting: Sequence[RequestSize], shapes: Sequence[WarmupShape]
) -> Optional[tuple[WarmupShape, list[int]]]:
    """Choose the next static batch from a waiting queue in arrival order.

    The oldest request is always in the batch, so a request that fits some
    shape is never starved.  For every shape that fits the oldest request,
    the batch takes the waiting requests that fit that shape, in arrival
    order, up to its batch size; the shape that admits the most requests
    wins, and among equals the cheapest.  Finally the batch runs on the
    cheapest shape that holds it (never more expensive than the winner).

    Returns ``(shape, indices into waiting)``, or None if ``waiting`` is
    empty or its oldest request fits no shape.
    """
    if not waiting:
        return None
    best: Optional[tuple[int, tuple, list[int]]] = None
    for shape in shapes:
        if not fits(shape, waiting[0]):
            continue
        chosen = [i for i, r in enumerate(waiting)
                  if fits(shape, r)][:shape.batch_size]
        key = (-len(chosen), shape.cost)
        if best is None or key < best[:2]:
            best = (key[0], key[1], chosen)
    if best is None:
        return None
    indices = best[2]
    shape = choose_shape([waiting[i] for i in indices], shapes)
    assert shape is not None
    return shape, indices


def rejection_reason(req: RequestSize,
                     shapes: Sequence[WarmupShape]) -> Optional[str]:
    """Why a request can never be served, or None if some shape fits it."""
    if any(fits(s, req) for s in shapes):
        return None
    listed = ", ".join(str(s) for s in shapes)
    return (f"The request (prompt length {req.prompt_len}, max_tokens "
            f"{req.max_tokens}) fits none of the compiled Spyre warm-up "
            f"shapes: {listed}. Shorten the prompt or lower max_tokens, or "
            "add a larger shape to VLLM_SPYRE_WARMUP_PROMPT_LENS / "
            "VLLM_SPYRE_WARMUP_NEW_TOKENS / VLLM_SPYRE_WARMUP_BATCH_SIZES.")


def parallel_samples_reason(n: int,
                            shapes: Sequence[WarmupShape]) -> Optional[str]:
    """Why the ``n`` samples of one request (``n`` or ``best_of``) can never
    share a batch, or None."""
    largest = max(s.batch_size for s in shapes)
    if n <= largest:
        return None
    return (f"n={n} parallel samples of one request are more than the "
            f"largest batch size {largest} of the compiled Spyre warm-up "
            "shapes. Lower n (or best_of), or add a larger batch size to "
            "VLLM_SPYRE_WARMUP_BATCH_SIZES.")
