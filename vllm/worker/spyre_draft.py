"""DraftModel: a smaller model's greedy proposals for speculative decoding.

With ``--speculative-config '{"model": <folder>, "num_speculative_tokens":
k}'`` (``"method": "draft_model"``) a model with the served model's
tokenizer proposes each running sequence's next ``k`` tokens, its argmax
at each, which the verify step (``spyre_spec_model_runner``) keeps while
the served model samples the same.

The draft model is a ``SpyreCBCausalLM`` of its own, compiled for the same
backend, with a block pool of its own of as many blocks as the served
model's: a sequence's block table addresses both pools, so the draft needs
no block manager.  It keeps, per request, how many positions its pool holds
(``fed``):

* a prefill (or a chunk) of the served model runs on the draft model too,
  the same paged inputs (``prefill``);
* before proposing, the positions since ``fed`` are caught up in one pass
  of ``k + 1`` positions, a verify step's shape (after a verify step: the
  accepted proposal and the token after it), or as a prefill where more
  lag (steps that did not speculate), and the argmax at the last gives the
  first proposal; ``k - 1`` decode steps give the rest (``propose``);
* after the verify step the proposals it kept stay in the pool, and
  ``fed`` is moved past them (``verified``); the rest are written over.

A block another sequence shares (prefix caching) holds what the draft
computed when it was filled, except positions the draft never caught up
on (a finished sequence's last ones): the draft's proposals there may be
worse, the emitted tokens never change, since the served model checks
every one.  The draft runs in the driver worker's process only, unsharded
also under tensor parallelism (``spyre_one_rank``): it proposes before the
step is sent to the other ranks, and its prefills are its own.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.spyre import CB_BLOCK_SIZE, SpyreConfig
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.logger import init_logger
from vllm.model_executor.models.spyre_cb_causal_lm import SpyreCBCausalLM
from vllm.platforms import current_platform
from vllm.worker.spyre_cb_inputs import (decode_batch, prefill_chunks,
                                         verify_batch, whole_prefill_len)
from vllm.worker.spyre_one_rank import draft_vllm_config, one_rank
from vllm.worker.spyre_spec_cost import best_of

logger = init_logger(__name__)


class DraftModel:
    """The draft model, its block pool, and how far each sequence is in
    it."""

    def __init__(self, vllm_config: VllmConfig, spyre_config: SpyreConfig,
                 max_blocks: int, pad_id: int) -> None:
        self.vllm_config = draft_vllm_config(vllm_config)
        self.spyre_config = spyre_config
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_blocks = max_blocks
        self.pad_id = pad_id
        self.pad_block = -1
        self.model: Optional[SpyreCBCausalLM] = None
        #: Per request: positions the draft's pool holds.
        self.fed: dict[str, int] = {}
        #: Per request of the step being verified: (its length, proposals
        #: fed to the draft).
        self._pending: dict[str, tuple[int, int]] = {}

    # ---- start-up -------------------------------------------------------
    @one_rank()
    def load(self) -> None:
        start = time.perf_counter()
        with set_current_vllm_config(self.vllm_config):
            self.model = SpyreCBCausalLM(vllm_config=self.vllm_config,
                                         spyre_config=self.spyre_config)
        logger.info("Spyre speculative draft model %s load took %.1f s",
                    self.vllm_config.model_config.model,
                    time.perf_counter() - start)

    def block_bytes(self) -> int:
        assert self.model is not None
        return self.model.block_bytes()

    def allocate_pool(self, num_blocks: int, pad_block: int) -> None:
        """As many blocks as the served model's pool (``num_blocks``, its
        spare ``pad_block`` among them)."""
        assert self.model is not None
        self.model.allocate_pool(num_blocks)
        self.pad_block = pad_block

    def time_proposing(self, batch: int) -> float:
        """Seconds to propose ``k`` tokens for ``batch`` sequences."""
        ids = [f"warm-up {i}" for i in range(batch)]

        def propose():
            self._propose(ids, [[1, 1]] * batch, [[0]] * batch,
                          [self.k] * batch)
            self.forget(ids)

        return best_of(propose)

    @one_rank()
    def warmup(self, max_num_seqs: int) -> None:
        """Its three graphs: a prefill, decode steps and catch-up passes
        at the smallest and the largest batch, on the pool's first
        block."""
        length = min(CB_BLOCK_SIZE + 1, self.model.max_model_len)
        prompt = [self.pad_id] * max(length, 2)
        self.prefill(self._chunks(prompt, [0] * blocks_needed(
            len(prompt), CB_BLOCK_SIZE)))
        for batch in sorted({1, max_num_seqs}):
            self.model(self._decode([1] * batch, [2] * batch, [[0]] * batch))
            self.model.verify(self._verify([1] * batch, [[1] * self.k] *
                                           batch, [2] * batch,
                                           [[0]] * batch))

    # ---- per step -------------------------------------------------------
    @current_platform.inference_mode()
    @one_rank()
    def prefill(self, chunks: PagedInputs) -> torch.Tensor:
        """The served model's prefill rows, on the draft's pool; the last
        position's logits."""
        assert self.model is not None
        for i in range(chunks.input_ids.shape[0]):
            logits = self.model(chunks.row(i))
        return logits

    def propose(self, metas: Sequence, seqs: Sequence,
                rooms: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Up to ``rooms[i]`` proposals for each running sequence (its
        group and its (id, data))."""
        return self._propose(
            [m.request_id for m in metas],
            [d.get_token_ids() for _, d in seqs],
            [m.block_tables[i] for m, (i, _) in zip(metas, seqs)], rooms)

    def stepped(self, model_input, outputs, hidden) -> None:
        """After a step: its prefill runs on the draft's pool too; a verify
        step's kept proposals stay in it (``verified``)."""
        if model_input.prefill is not None:
            self.prefill(model_input.prefill)
            self.fed[model_input.prefill_request] = int(
                model_input.prefill.position_ids.max()) + 1
        if model_input.verify is None or outputs is None:
            return
        offset = len(outputs) - len(model_input.proposals)
        for meta, group, proposed in zip(model_input.decode_metas,
                                         outputs[offset:],
                                         model_input.proposals):
            if proposed:
                self.verified(meta.request_id, len(group.samples) - 1)

    @current_platform.inference_mode()
    @one_rank()
    def _propose(self, request_ids: Sequence[str],
                 tokens: Sequence[Sequence[int]],
                 tables: Sequence[Sequence[int]],
                 rooms: Sequence[int]) -> tuple[tuple[int, ...], ...]:
        """Up to ``rooms[i]`` proposals for each sequence (its token ids
        and block table), greedy."""
        rows = [i for i, room in enumerate(rooms) if room > 0]
        out: list[list[int]] = [[] for _ in rooms]
        if not rows:
            return ()
        width = self.k + 1
        caught, behind = [], []
        for i in rows:
            lag = len(tokens[i]) - self.fed.get(request_ids[i], 0)
            (caught if lag <= width else behind).append(i)
        for i in behind:  # a prefill of what it lags by
            fed = self.fed.get(request_ids[i], 0)
            logits = self.prefill(self._chunks(tokens[i], tables[i], fed))
            out[i].append(int(logits[0].argmax()))
        if caught:
            starts = [self.fed.get(request_ids[i], 0) for i in caught]
            lags = [len(tokens[i]) - s for i, s in zip(caught, starts)]
            logits = self.model.verify(self._verify(
                [tokens[i][s] for i, s in zip(caught, starts)],
                [tokens[i][s + 1:] for i, s in zip(caught, starts)],
                [s + 1 for s in starts], [tables[i] for i in caught]))
            for row, (i, lag) in enumerate(zip(caught, lags)):
                out[i].append(int(logits[row, lag - 1].argmax()))
        for step in range(1, self.k):
            going = [i for i in rows if rooms[i] > step]
            if not going:
                break
            logits = self.model(self._decode(
                [out[i][-1] for i in going],
                [len(tokens[i]) + step for i in going],
                [tables[i] for i in going]))
            for row, i in enumerate(going):
                out[i].append(int(logits[row].argmax()))
        for i in rows:
            self._pending[request_ids[i]] = (len(tokens[i]), rooms[i] - 1)
        return tuple(tuple(p) for p in out)

    def verified(self, request_id: str, accepted: int) -> None:
        """The verify step kept ``accepted`` proposals of the request:
        those the draft was fed stay valid in its pool."""
        length, fed = self._pending.pop(request_id, (None, 0))
        if length is not None:
            self.fed[request_id] = length + min(accepted, fed)

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self.fed.pop(request_id, None)
            self._pending.pop(request_id, None)

    # ---- inputs ---------------------------------------------------------
    def _chunks(self, tokens: Sequence[int], blocks: Sequence[int],
                start: int = 0) -> PagedInputs:
        assert self.model is not None
        whole = self.model.prefill_len_range is not None
        return prefill_chunks(
            tokens, blocks[:self.max_blocks], CB_BLOCK_SIZE, self.max_blocks,
            self.pad_id, self.pad_block,
            whole_prefill_len(len(tokens) - start) if whole else
            CB_BLOCK_SIZE, start)

    def _decode(self, last: Sequence[int], lens: Sequence[int],
                tables: Sequence[Sequence[int]]) -> PagedInputs:
        return decode_batch(last, lens, [t[:self.max_blocks] for t in tables],
                            CB_BLOCK_SIZE, self.max_blocks, self.pad_id,
                            self.pad_block)

    def _verify(self, last: Sequence[int], after: Sequence[Sequence[int]],
                lens: Sequence[int],
                tables: Sequence[Sequence[int]]) -> PagedInputs:
        return verify_batch(last, after, lens,
                            [t[:self.max_blocks] for t in tables],
                            self.k + 1, CB_BLOCK_SIZE, self.max_blocks,
                            self.pad_id, self.pad_block)
