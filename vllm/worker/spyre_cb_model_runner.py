"""SpyreCBModelRunner: continuous batching over a paged key/value cache.

The scheduler (``SpyreCBScheduler``) sends the prefill of one sequence, a
decode step of every running sequence, or (chunked prefill) one chunk of a
prefill and the decodes, each sequence with the blocks vLLM's block
manager gave it.  A prefill computes the positions its cached blocks
(prefix caching) and earlier chunks do not hold.  The runner keeps no
batch state between steps: everything a step needs is in its
sequence-group metadata.

``execute_model`` is the whole step: paged inputs (``spyre_cb_inputs``) ->
``SpyreCBCausalLM`` forward (a prefill in one pass on the paged kernel,
else chunk by chunk; then the decode batch) -> the logits of the rows that
sample -> vLLM logits processor -> vLLM sampler.

Start-up: ``load_model`` loads and compiles the model; the worker then
sizes the block pool, ``allocate_pool`` allocates it, and ``warmup`` runs
each of the two graphs (prefill, dynamic decode batch) so serving
compiles nothing.  The pool has one block more than vLLM's block manager
knows of: the spare block that padding positions write to.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.config import VllmConfig
from vllm.config.spyre import CB_BLOCK_SIZE, SpyreConfig
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.lora.spyre_lora import StepAdapters, step_adapters
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.layers.spyre_mamba import StateRows
from vllm.model_executor.models.spyre_cb_causal_lm import SpyreCBCausalLM
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.platforms import current_platform
from vllm.sequence import SequenceGroupMetadata
from vllm.worker import spyre_prompt_logprobs as prompt_logprobs
from vllm.worker.spyre_cb_inputs import (decode_batch, prefill_chunks,
                                         prefill_span, whole_prefill_len)
from vllm.worker.spyre_image_inputs import ImageEmbeds, ImagePrefill
from vllm.worker.spyre_runner_base import (SpyreModelInputBase,
                                           SpyreRunnerBase, only_seq, sample)
from vllm.worker.spyre_state_slots import StateSlots

logger = init_logger(__name__)


@dataclass(frozen=True)
class SpyreCBModelInput(SpyreModelInputBase):
    """One step, built on the driver worker: a prefill of one sequence
    (its rows: one, or its chunks), a decode step of the running
    sequences (the first ``num_live`` rows, in the order of the step's
    sequence groups), or, with chunked prefill, both: the prefill first,
    as vLLM's scheduler orders the groups."""

    NESTED = {"prefill": PagedInputs, "decode": PagedInputs,
              "prefill_states": StateRows, "decode_states": StateRows,
              "prefill_images": ImagePrefill, "prefill_image_tensors": dict}
    LOCAL = ("sampling_metadata", )

    prefill: Optional[PagedInputs]
    decode: Optional[PagedInputs]
    num_live: int
    #: Whether the prefill reaches the sequence's last position, whose
    #: logits are sampled (a chunk before the last is not).
    sample_prefill: bool = True
    sampling_metadata: Optional[SamplingMetadata] = None
    #: A prefill asking for prompt log-probabilities: its token ids and
    #: how many top tokens it asks for (``spyre_prompt_logprobs``); else
    #: None and 0, and then not broadcast.
    logprob_ids: Optional[torch.Tensor] = None
    logprob_k: int = 0
    #: A hybrid model's Mamba-2 state slots of the prefill's and the
    #: decode's rows (``spyre_mamba.StateRows``); else None.
    prefill_states: Optional[StateRows] = None
    decode_states: Optional[StateRows] = None
    #: With ``--enable-lora``: the adapters of the step's requests, the
    #: prefill's lora id and the decode rows' (0: none); else not sent.
    lora_requests: Optional[tuple[LoRARequest, ...]] = None
    prefill_lora: int = 0
    decode_loras: Optional[tuple[int, ...]] = None
    #: A prefill with images: what every rank needs to embed them, and
    #: the images' tensors (``spyre_image_inputs``); else None.
    prefill_images: Optional[ImagePrefill] = None
    prefill_image_tensors: Optional[dict[str, torch.Tensor]] = None


class SpyreCBModelRunner(SpyreRunnerBase[SpyreCBModelInput]):

    model_cls = SpyreCBCausalLM
    input_cls = SpyreCBModelInput
    runs_vllm_model_code = True
    model: Optional[SpyreCBCausalLM]  # type: ignore[assignment]

    def __init__(self, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config, spyre_config)
        #: Width of every block table: the blocks of a max_model_len sequence.
        self.max_blocks = blocks_needed(self.scheduler_config.max_model_len,
                                        CB_BLOCK_SIZE)
        #: The block padding positions write to; set by allocate_pool.
        self.pad_block = -1
        #: Prompt positions computed by prefills so far (a cached prefix
        #: is not computed; a recomputed sequence is computed again).
        self.prompt_tokens_computed = 0
        #: A hybrid model's Mamba-2 state slot of each running request
        #: (driver only); set by allocate_pool.
        self.state_slots: Optional[StateSlots] = None
        #: A model that takes images: its prefills' embeddings; set by
        #: allocate_pool.
        self.images: Optional[ImageEmbeds] = None

    # ---- start-up -------------------------------------------------------
    def block_bytes(self) -> int:
        assert self.model is not None
        return self.model.block_bytes()

    def state_bytes(self) -> int:
        """Bytes a hybrid model's Mamba-2 state slots take (else 0)."""
        assert self.model is not None
        return self.model.state_bytes()

    def allocate_pool(self, num_blocks: int) -> None:
        """``num_blocks`` for vLLM's block manager, plus the spare block."""
        assert self.model is not None
        self.model.allocate_pool(num_blocks + 1)
        self.pad_block = num_blocks
        if self.model.state_layout is not None:
            self.state_slots = StateSlots(self.model.state_slot_count)
        if self.model.code.embeds_prompts:
            self.images = ImageEmbeds(
                self.model.code, self.pad_id,
                getattr(self.model_config.hf_config, "image_token_index",
                        None))

    @current_platform.inference_mode()
    def warmup(self) -> None:
        """Compiles both graphs: a prefill of 65 tokens (two chunks where
        prefills are chunked; shorter if ``max_model_len`` is), then decode
        steps at the smallest and the largest batch (one dynamic graph),
        all on the pool's first block, which nothing holds yet."""
        assert self.model is not None
        self.model.require_precompiled()
        start = time.perf_counter()
        before = self.model.graph_cache_stats()
        vocab = self.model_config.get_vocab_size()
        gen = torch.Generator().manual_seed(0)
        length = min(CB_BLOCK_SIZE + 1, self.scheduler_config.max_model_len)
        prompt = torch.randint(0, vocab, (max(length, 2), ),
                               generator=gen).tolist()
        blocks = [0] * blocks_needed(len(prompt), CB_BLOCK_SIZE)
        chunks = self._chunks(prompt, blocks)
        # A hybrid model's warm-up writes the slot the first request will
        # get, which its prefill starts from zero states anyway.
        self._prefill(chunks, self._prefill_states(0, chunks, len(prompt),
                                                   True))
        for batch in sorted({1, self.scheduler_config.max_num_seqs}):
            step = self._decode([prompt[-1]] * batch, [2] * batch,
                                [[0]] * batch)
            self._forward(step, self._decode_states([], step))
        seconds = time.perf_counter() - start
        self.startup_timings["warmup"] = seconds
        logger.info("Spyre continuous-batching warm-up took %.1f s (%s)",
                    seconds, self.graph_source(before))

    # ---- per step -------------------------------------------------------
    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        virtual_engine: int = 0,
        finished_requests_ids: Optional[list[str]] = None,
    ) -> SpyreCBModelInput:
        """The step's prefill (one sequence: the positions the pool does
        not hold yet, up to the scheduler's chunk; the outputs too after a
        preemption) and decode (every running sequence), over the blocks
        vLLM's block manager gave each sequence."""
        metas = list(seq_group_metadata_list)
        if self.state_slots is not None:
            self.state_slots.release(finished_requests_ids or ())
        prefills = [m for m in metas if m.is_prompt]
        if len(prefills) > 1 or metas[:len(prefills)] != prefills:
            raise RuntimeError(
                "a continuous-batching step holds at most one prefill, "
                f"first; got {len(prefills)} of {len(metas)} groups")
        decodes = metas[len(prefills):]
        prefill = None
        images: dict = {}
        prefill_states = None
        sample_prefill = True
        seq_lens, query_lens = [], []
        logprob_ids = None
        logprob_k = 0
        if prefills:
            meta = prefills[0]
            seq_id, data = _seq(meta)
            tokens = data.get_token_ids()  # the outputs too, on recompute
            computed = data.get_num_computed_tokens()
            cached = len(meta.computed_block_nums or []) * CB_BLOCK_SIZE
            if cached:
                data.update_num_cached_tokens(cached)
            start, end = prefill_span(len(tokens), computed,
                                      meta.token_chunk_size or len(tokens),
                                      cached)
            prefill = self._chunks(tokens[:end], meta.block_tables[seq_id],
                                   start, cached)
            if self.images is not None:
                images = self.images.prefill(meta, tokens, start, end)
            if self.state_slots is not None:
                slot = (self.state_slots.start(meta.request_id) if start == 0
                        else self.state_slots.of(meta.request_id))
                prefill_states = self._prefill_states(slot, prefill,
                                                      end - start,
                                                      start == 0)
            self.prompt_tokens_computed += end - start
            sample_prefill = meta.do_sample
            seq_lens.append(end)
            query_lens.append(end - start)
            asking = prompt_logprobs.wanted(prefills)
            if asking:
                if computed == 0:  # every position, at the first chunk
                    logprob_ids = torch.tensor(tokens, dtype=torch.long)
                    logprob_k = meta.sampling_params.prompt_logprobs
                metas[0] = prompt_logprobs.for_sampler(prefills, asking)[0]
        decode_fields: dict = dict(decode=None)
        if decodes:
            seqs = [_seq(m) for m in decodes]
            lens = [d.get_len() for _, d in seqs]
            decode_fields = self._decode_fields(decodes, seqs, lens)
            seq_lens += lens
            query_lens += [1] * len(seqs)
        sampling_metadata = self.sampling_metadata(metas, seq_lens,
                                                   query_lens,
                                                   finished_requests_ids)
        loras = {}
        if self.lora_config is not None:
            loras = dict(
                lora_requests=step_adapters(metas),
                prefill_lora=prefills[0].lora_int_id if prefills else 0,
                decode_loras=tuple(m.lora_int_id for m in decodes))
        return self.input_cls(prefill=prefill,
                              num_live=len(decodes),
                              sample_prefill=sample_prefill,
                              sampling_metadata=sampling_metadata,
                              logprob_ids=logprob_ids,
                              logprob_k=logprob_k,
                              prefill_states=prefill_states,
                              **decode_fields,
                              **loras,
                              **images)

    def run_step(
        self, model_input: SpyreCBModelInput
    ) -> Optional[list[SamplerOutput]]:
        """Runs the step on the block pool the model owns: the prefill,
        then the decode batch; samples the rows that sample."""
        rows = []
        adapters = model_input.lora_requests or ()
        if model_input.prefill is not None:
            prefill = model_input.prefill
            if model_input.prefill_images is not None:
                assert self.images is not None
                prefill = self.images.chunks(
                    prefill, model_input.prefill_images,
                    model_input.prefill_image_tensors or {})
            logits = self._prefill(prefill,
                                   model_input.prefill_states,
                                   (adapters, (model_input.prefill_lora, )))
            if model_input.sample_prefill:
                rows.append(logits)
        decoded = self._decode_rows(model_input)
        if decoded is not None:
            rows.append(decoded)
        computed = {}
        if model_input.logprob_ids is not None:
            assert self.model is not None
            if self.model.lora is not None:
                self.model.lora.one_sequence(adapters,
                                             model_input.prefill_lora,
                                             len(model_input.logprob_ids))
            computed[0] = prompt_logprobs.compute(
                self.model, model_input.logprob_ids,
                model_input.logprob_k)
        if model_input.sampling_metadata is None:
            return []  # a non-driver rank: the driver samples
        if len(rows) == 1:
            logits = rows[0]  # [N, vocab]
        else:  # a prefill chunk and decodes, or a chunk that samples nothing
            logits = torch.cat(rows) if rows else torch.empty(
                0, self.model_config.get_vocab_size())
        return [prompt_logprobs.attach(
            sample(self.get_model(), logits, model_input.sampling_metadata),
            computed)]

    def _decode_fields(self, metas: list[SequenceGroupMetadata], seqs: list,
                       lens: list[int]) -> dict:
        """The step input's fields of the running sequences' decodes
        (``metas``; ``seqs`` their (id, data), ``lens`` their lengths):
        the decode batch, and a hybrid model's state rows."""
        decode = self._decode(
            [d.get_last_token_id() for _, d in seqs], lens,
            [m.block_tables[i] for m, (i, _) in zip(metas, seqs)])
        fields = dict(decode=decode)
        if self.state_slots is not None:
            fields["decode_states"] = self._decode_states(
                [self.state_slots.of(m.request_id) for m in metas], decode)
        return fields

    def _decode_rows(
            self, model_input: SpyreCBModelInput) -> Optional[torch.Tensor]:
        """The logits the step's decode rows sample from (``[num_live,
        vocab]``), or None without decodes."""
        if model_input.decode is None:
            return None
        return self._forward(
            model_input.decode, model_input.decode_states,
            (model_input.lora_requests or (), model_input.decode_loras)
        )[:model_input.num_live]

    # ---- helpers --------------------------------------------------------
    def _chunks(self, tokens: list[int], blocks: list[int], start: int = 0,
                cached: int = 0) -> PagedInputs:
        """The prefill's rows for positions ``start`` onwards
        (``spyre_cb_inputs.prefill_chunks``): one row where the prefill
        graph's length is dynamic, else chunks of a block each."""
        assert self.model is not None
        whole = self.model.prefill_len_range is not None
        return prefill_chunks(
            tokens, blocks, CB_BLOCK_SIZE, self.max_blocks, self.pad_id,
            self.pad_block,
            whole_prefill_len(len(tokens) - start) if whole else
            CB_BLOCK_SIZE, start, cached)

    def _decode(self, tokens: list[int], lens: list[int],
                tables: list[list[int]]) -> PagedInputs:
        # A speculating sequence near max_model_len holds lookahead blocks
        # beyond it, which no step writes.
        return decode_batch(tokens, lens,
                            [t[:self.max_blocks] for t in tables],
                            CB_BLOCK_SIZE, self.max_blocks, self.pad_id,
                            self.pad_block)

    def _prefill_states(self, slot: int, chunks: PagedInputs, real: int,
                        first: bool) -> Optional[StateRows]:
        """A hybrid model's state rows of a prefill (None otherwise)."""
        if self.state_slots is None:
            return None
        rows, length = chunks.input_ids.shape
        return StateRows.prefill(slot, rows, length, real, first)

    def _decode_states(self, slots: list[int],
                       step: PagedInputs) -> Optional[StateRows]:
        """A hybrid model's state rows of a decode step: the sequences'
        slots, padding rows on the spare one (None otherwise)."""
        if self.state_slots is None:
            return None
        return StateRows.decode(slots, step.input_ids.shape[0],
                                self.state_slots.spare)

    def _prefill(self, chunks: PagedInputs,
                 states: Optional[StateRows] = None,
                 loras: Optional[StepAdapters] = None) -> torch.Tensor:
        """Runs the rows (one, or the chunks) in order; the last
        one's logits: [1, vocab]."""
        for i in range(chunks.input_ids.shape[0]):
            logits = self._forward(chunks.row(i),
                                   states.row(i) if states else None, loras)
        return logits

    def _forward(self, step: PagedInputs,
                 states: Optional[StateRows] = None,
                 loras: Optional[StepAdapters] = None) -> torch.Tensor:
        """One forward of ``step``; ``loras``: the step's adapters and
        the lora id of each live row (``spyre_lora``)."""
        assert self.model is not None
        if self.model.lora is not None:
            self.model.lora.set_step(loras, *step.input_ids.shape)
        if states is None:
            return self.model(step)
        return self.model(step, states)


def _seq(meta: SequenceGroupMetadata):
    """(sequence id, sequence data) of a one-sequence group."""
    data = only_seq(meta)
    return next(iter(meta.seq_data)), data
