"""The inputs of one paged attention step, shared by the continuous-batching
model and the runner that builds them.

A step of continuous batching is B rows of L positions over the block pool:
token ids and positions, the pool slot each position writes, each row's
block table and, per position, how many tokens of its sequence it sees.
The runner builds them (``vllm.worker.spyre_cb_inputs``); the model
(``SpyreCBCausalLM``) marks their dynamic dimensions within the bounds
below and hands them to the ``spyre_paged_cache`` attention ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

#: Smallest decode batch: rows beyond the running sequences are padding.
MIN_DECODE_BATCH = 2
#: Fewest positions of a prefill run in one pass (dynamo specialises a
#: length of 1 as it does a batch of 1): a one-token prompt is left-padded.
MIN_PREFILL_LEN = 2


@dataclass(frozen=True)
class PagedInputs:
    """Tensors of one forward pass over the block pool (B rows of L
    positions).  A prefill holds its chunks as rows, run one at a time."""

    input_ids: torch.Tensor  # [B, L] int64
    position_ids: torch.Tensor  # [B, L] int64
    cache_slots: torch.Tensor  # [B, L] int64: pool slot each position writes
    block_table: torch.Tensor  # [B, max_blocks] int64
    ctx_lens: torch.Tensor  # [B, L] int64: tokens each position sees
    #: [B, L, hidden]: a multimodal model's prefill takes the positions'
    #: embeddings (an image's at its placeholders) in place of their ids.
    inputs_embeds: Optional[torch.Tensor] = None

    def row(self, i: int) -> "PagedInputs":
        """Row ``i`` as a batch of one (one prefill pass or chunk)."""
        return PagedInputs(*(None if t is None else t[i:i + 1].clone()
                             for t in (self.input_ids, self.position_ids,
                                       self.cache_slots, self.block_table,
                                       self.ctx_lens, self.inputs_embeds)))
