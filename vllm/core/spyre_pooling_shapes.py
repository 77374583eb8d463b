"""Which texts pack into which compiled shapes, for pooling models.

A pooling shape is ``(prompt_len, batch_size)``: ``batch_size`` rows of
``prompt_len`` token slots, run once.  Many short texts share one row, each
placed first-fit in arrival order.  The scheduler
(``SpyrePoolingScheduler``) refuses a text longer than every shape
(``rejection_reason``) and takes from its waiting queue the texts that fit
one shape together (``select_texts``); the model runner places the texts
it receives with the same first-fit rule (``choose_pooling_shape``), so
both agree.  Nothing here touches a model, a scheduler or a tensor.

The module sits beside the schedulers but at the bottom of the project's
layers, above the settings only: the workers read it as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from vllm.config.spyre import WarmupShape


@dataclass(frozen=True)
class Placement:
    """Where one text sits: its row and the slot of its first token."""

    row: int
    offset: int


def first_fit(lengths: Sequence[int],
              shape: WarmupShape) -> Optional[list[Placement]]:
    """Places texts of ``lengths`` tokens, in order, each into the first row
    with room; None if one does not fit."""
    fill = [0] * shape.batch_size
    placements = []
    for n in lengths:
        row = _row_with_room(fill, n, shape.prompt_len)
        if row is None:
            return None
        placements.append(Placement(row, fill[row]))
        fill[row] += n
    return placements


def _row_with_room(fill: list[int], n: int, slots: int) -> Optional[int]:
    """The first row whose used slots (``fill``) leave room for ``n``."""
    return next((r for r, used in enumerate(fill) if used + n <= slots),
                None)


def choose_pooling_shape(
    lengths: Sequence[int], shapes: Sequence[WarmupShape]
) -> Optional[tuple[WarmupShape, list[Placement]]]:
    """The cheapest shape that holds every text at once, and where each
    text goes; None if no shape does."""
    for shape in sorted(shapes, key=lambda s: s.cost):
        placements = first_fit(lengths, shape)
        if placements is not None:
            return shape, placements
    return None


def select_texts(waiting: Sequence[int], shapes: Sequence[WarmupShape],
                 max_texts: int) -> list[int]:
    """Indices (into ``waiting``, token counts in arrival order) of the
    texts the next step runs.

    The oldest text is always taken, so no text that fits some shape
    starves.  For each shape that holds the oldest text, the waiting texts
    are placed first-fit in arrival order, a text that does not fit being
    left for a later step, up to ``max_texts``; the shape that takes the
    most texts wins, among equals the cheapest.  Returns [] when the queue
    is empty or its oldest text fits no shape.
    """
    best: Optional[tuple[tuple, list[int]]] = None
    for shape in shapes:
        if not waiting or waiting[0] > shape.prompt_len:
            continue
        fill = [0] * shape.batch_size
        taken = []
        for i, n in enumerate(waiting):
            if len(taken) == max_texts:
                break
            row = _row_with_room(fill, n, shape.prompt_len)
            if row is not None:
                fill[row] += n
                taken.append(i)
        key = (-len(taken), shape.cost)
        if best is None or key < best[0]:
            best = (key, taken)
    return best[1] if best is not None else []


def rejection_reason(length: int,
                     shapes: Sequence[WarmupShape]) -> Optional[str]:
    """Why a text of ``length`` tokens can never be run, or None."""
    longest = max(s.prompt_len for s in shapes)
    if length <= longest:
        return None
    lens = ", ".join(str(p) for p in sorted({s.prompt_len for s in shapes}))
    return (f"The input has {length} tokens, more than the longest compiled "
            f"Spyre warm-up shape holds ({longest}; prompt lengths: {lens}). "
            "Shorten it, set truncate_prompt_tokens, or add a longer prompt "
            "length to VLLM_SPYRE_WARMUP_PROMPT_LENS.")
