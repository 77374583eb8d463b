"""SpyreSpecModelRunner: continuous batching with speculative decoding.

With ``--speculative-config`` a decode step becomes a verify step where
running sequences have proposals (n-gram prompt lookup, ``spyre_ngram``;
a draft model's, ``spyre_draft``; an MLP speculator's from the served
model's hidden states, ``spyre_mlp_speculator``) and verifying them pays
(``spyre_spec_cost``: the tokens it is expected to emit against its time,
a draft model's proposing included, over a decode step's, both measured
at warm-up): each sequence's last token and up to ``k`` proposed
tokens, ``[B, k + 1]`` positions in one pass over the block pool (the
verify graph, ``SpyreCBCausalLM.verify``), their keys and values written
into the lookahead slots vLLM's block manager gave the sequence.  Any
other step is the plain decode step.

Acceptance, position by position through vLLM's logits processors and
sampler (``_accept``): the token sampled at a sequence's first position
is emitted; while it equals the proposal there, the next position's
token, sampled with the proposal counted as output (penalties, minimum
tokens), is emitted too.  The first mismatch ends the sequence's tokens
for the step, and a sequence whose proposals all hold gets the token
after them as well.  Proposals are deterministic, so keeping a proposal
exactly when the target samples it is the rejection-sampling rule for
them: greedy requests get the tokens plain decoding gives, sampled ones
the target's distribution, seeded ones reproduce themselves (their
generator draws once per position sampled).

The keys and values of rejected positions stay in the slots after the
sequence's end, where the next step writes over them before any position
attends to them.  A request's grammar (structured output) masks every
position it samples, after the proposals kept before it, so a proposal
outside the grammar is never sampled and so never kept; requests with
other logits processors propose nothing (a processor may count on one
new token per call).

The step's groups carry one ``SequenceOutput`` per emitted token
(``SpeculativeGroupOutput``, with the number proposed), which the engine's
``SpyreSpeculativeOutputProcessor`` appends one at a time.
"""
from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from typing import Optional

import torch

from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.config import VllmConfig
from vllm.config.spyre import CB_BLOCK_SIZE, SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.platforms import current_platform
from vllm.sequence import (CompletionSequenceGroupOutput, SequenceData,
                           SequenceGroupMetadata)
from vllm.worker import spyre_ngram
from vllm.worker.spyre_draft import DraftModel
from vllm.worker.spyre_mlp_speculator import MLPSpeculatorProposer
from vllm.worker.spyre_spec_cost import VerifyCost, best_of
from vllm.worker.spyre_cb_inputs import verify_batch
from vllm.worker.spyre_cb_model_runner import (SpyreCBModelInput,
                                               SpyreCBModelRunner, _seq)
from vllm.worker.spyre_runner_base import sample

logger = init_logger(__name__)


class SpeculativeGroupOutput(CompletionSequenceGroupOutput):
    """A sequence group's output of a verify step: one sample per emitted
    token, and how many tokens were proposed."""

    proposed: int = 0


@dataclass(frozen=True)
class SpyreSpecModelInput(SpyreCBModelInput):
    """A continuous-batching step whose decodes may be a verify step."""

    NESTED = dict(SpyreCBModelInput.NESTED, verify=PagedInputs)
    LOCAL = SpyreCBModelInput.LOCAL + ("proposals", "decode_metas",
                                       "prefill_request")

    #: The verify step, in place of ``decode``; else None.
    verify: Optional[PagedInputs] = None
    #: Driver only: each decode row's proposals (a verify step) and its
    #: group; the prefill's request.
    proposals: Optional[tuple[tuple[int, ...], ...]] = None
    decode_metas: Optional[tuple[SequenceGroupMetadata, ...]] = None
    prefill_request: Optional[str] = None


#: The proposers of the methods that run a model, by method.
PROPOSERS = {"draft_model": DraftModel,
             "mlp_speculator": MLPSpeculatorProposer}


class SpyreSpecModelRunner(SpyreCBModelRunner):

    input_cls = SpyreSpecModelInput
    speculates = True

    def __init__(self, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config, spyre_config)
        spec = vllm_config.speculative_config
        assert spec is not None
        self.k = spec.num_speculative_tokens
        self.lookup = (spec.prompt_lookup_min or 1,
                       spec.prompt_lookup_max or spec.prompt_lookup_min or 1)
        self.backoff = spyre_ngram.Backoff()
        #: vLLM's ``disable_by_batch_size``: if set, a step with proposals
        #: verifies while it runs at most this many sequences, in place of
        #: the measured ``cost``.
        self.max_verify_batch: Optional[int] = spec.disable_by_batch_size
        #: When a verify step pays; measured by ``warmup``.
        self.cost: Optional[VerifyCost] = None
        #: The verify graph's logits of the step being sampled (driver).
        self._verified: Optional[torch.Tensor] = None
        #: The draft model or MLP speculator (``PROPOSERS``), else None
        #: (n-gram lookup, or a rank that does not build the steps); set
        #: by ``load_model``.
        self.proposer: Optional[DraftModel | MLPSpeculatorProposer] = None
        #: Whether this rank builds the steps and so proposes (the driver
        #: worker's; set by the worker).
        self.proposes = True
        #: The served model's hidden states of the step's prefill and
        #: decode rows, where the MLP speculator wants them (driver).
        self._hidden: list[Optional[torch.Tensor]] = [None, None]

    # ---- start-up -------------------------------------------------------
    def load_model(self) -> None:
        super().load_model()
        proposer = PROPOSERS.get(self.vllm_config.speculative_config.method)
        if proposer is not None and self.proposes:
            self.proposer = proposer(self.vllm_config, self.spyre_config,
                                     self.max_blocks, self.pad_id)
            self.proposer.load()

    def block_bytes(self) -> int:
        """A block of the served model's pool, and of a draft model's."""
        extra = self.proposer.block_bytes() if self.proposer else 0
        return super().block_bytes() + extra

    def allocate_pool(self, num_blocks: int) -> None:
        super().allocate_pool(num_blocks)
        if self.proposer is not None:
            self.proposer.allocate_pool(num_blocks + 1, self.pad_block)

    @current_platform.inference_mode()
    def warmup(self) -> None:
        """The continuous-batching graphs, then the verify graph at the
        smallest and the largest batch, and the draft model's graphs;
        then both steps' times there (``VerifyCost``), a draft model's
        proposing counted in the verify step's."""
        super().warmup()
        start = time.perf_counter()
        assert self.model is not None
        before = self.model.graph_cache_stats()
        batches = (1, self.scheduler_config.max_num_seqs)
        if self.proposer is not None:
            self.proposer.warmup(batches[1])
        steps = {}
        for batch in sorted(set(batches)):
            steps[batch] = (
                self._decode([1] * batch, [2] * batch, [[0]] * batch),
                verify_batch([1] * batch, [[1] * self.k] * batch,
                             [2] * batch, [[0]] * batch, self.k + 1,
                             CB_BLOCK_SIZE, self.max_blocks, self.pad_id,
                             self.pad_block))
            self._verify(steps[batch][1], None)
        seconds = time.perf_counter() - start
        self.startup_timings["warmup verify"] = seconds
        logger.info("Spyre speculative verify graph (%d positions) warm-up "
                    "took %.1f s (%s)", self.k + 1, seconds,
                    self.graph_source(before))
        if self.max_verify_batch is not None:
            logger.info(
                "Spyre speculative decoding: a step with proposals verifies "
                "while it runs at most %d sequences (disable_by_batch_size)",
                self.max_verify_batch)
            return
        times = {b: (best_of(lambda: self._forward(decode)),
                     best_of(lambda: self._verify(verify, None)) +
                     (self.proposer.time_proposing(b)
                      if self.proposer else 0.0))
                 for b, (decode, verify) in steps.items()}
        self.cost = VerifyCost(batches, (times[1][0], times[batches[1]][0]),
                               (times[1][1], times[batches[1]][1]))
        logger.info(
            "Spyre speculative decoding: a verify step costs %.2f decode "
            "steps at batch 1 and %.2f at batch %d; a step verifies when "
            "its proposals are expected to emit more tokens than that",
            self.cost.ratio(1), self.cost.ratio(batches[1]), batches[1])

    # ---- per step -------------------------------------------------------
    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        virtual_engine: int = 0,
        finished_requests_ids: Optional[list[str]] = None,
    ) -> SpyreSpecModelInput:
        """The continuous-batching step (its decodes from
        ``_decode_fields``), after finished requests are forgotten."""
        self.backoff.forget(finished_requests_ids or ())
        if self.cost is not None:
            self.cost.forget(finished_requests_ids or ())
        if self.proposer is not None:
            self.proposer.forget(finished_requests_ids or ())
        model_input = super().prepare_model_input(
            seq_group_metadata_list, virtual_engine, finished_requests_ids)
        prefills = [m for m in seq_group_metadata_list if m.is_prompt]
        if prefills:
            model_input = dataclasses.replace(
                model_input, prefill_request=prefills[0].request_id)
        return model_input  # type: ignore[return-value]

    def _decode_fields(self, metas: list[SequenceGroupMetadata], seqs: list,
                       lens: list[int]) -> dict:
        """A verify step where running sequences propose and verifying
        pays (``_verifies``); else the decode batch.  A model proposes
        only once the step is to verify."""
        rooms = [self._room(m) for m in metas]
        if self.proposer is None:
            proposals = tuple(
                tuple(spyre_ngram.propose(d.get_token_ids(), room,
                                          *self.lookup)) if room else ()
                for room, (_, d) in zip(rooms, seqs))
        elif any(rooms) and self._verifies(metas, rooms):
            proposals = self.proposer.propose(metas, seqs, rooms)
        else:
            proposals = ()
        if not any(proposals) or not self._verifies(
                metas, [len(p) for p in proposals]):
            return dict(super()._decode_fields(metas, seqs, lens),
                        decode_metas=tuple(metas))
        verify = verify_batch(
            [d.get_last_token_id() for _, d in seqs], proposals, lens,
            [m.block_tables[i][:self.max_blocks]
             for m, (i, _) in zip(metas, seqs)], self.k + 1, CB_BLOCK_SIZE,
            self.max_blocks, self.pad_id, self.pad_block)
        return dict(decode=None, verify=verify, proposals=proposals,
                    decode_metas=tuple(metas))

    def _verifies(self, metas: list[SequenceGroupMetadata],
                  proposed: list[int]) -> bool:
        """Whether a step with this many proposals per sequence verifies
        them."""
        if self.max_verify_batch is not None:
            return len(metas) <= self.max_verify_batch
        return self.cost is None or self.cost.pays(
            [m.request_id for m in metas], proposed)

    def _room(self, meta: SequenceGroupMetadata) -> int:
        """How many tokens a running sequence may propose: none while it
        pauses, for a request with logits processors other than a
        grammar's, or without room (its blocks, ``max_model_len``,
        ``max_tokens``)."""
        params = meta.sampling_params
        if params is None or not all(
                getattr(p, "follows_tokens", False)
                for p in params.logits_processors or ()):
            return 0
        if not self.backoff.proposes(meta.request_id):
            return 0
        seq_id, data = _seq(meta)
        length = data.get_len()
        room = min(self.k,
                   len(meta.block_tables[seq_id]) * CB_BLOCK_SIZE - length,
                   self.scheduler_config.max_model_len - length)
        if params.max_tokens is not None:
            room = min(room,
                       params.max_tokens - data.get_output_len() - 1)
        return max(room, 0)

    def _decode_rows(
            self, model_input: SpyreSpecModelInput  # type: ignore[override]
    ) -> Optional[torch.Tensor]:
        """A verify step's logits: all kept for ``_accept``, the first
        position's sampled with the step's other rows."""
        verify = model_input.verify
        if verify is None:
            logits = super()._decode_rows(model_input)
            self._hidden[1] = self.model.last_hidden
            return logits
        logits = self._verify(
            verify,
            (model_input.lora_requests or (), model_input.decode_loras))
        self._hidden[1] = self.model.last_hidden
        self._verified = logits[:model_input.num_live]
        return self._verified[:, 0]

    def _prefill(self, chunks: PagedInputs, states=None,
                 loras=None) -> torch.Tensor:
        logits = super()._prefill(chunks, states, loras)
        self._hidden[0] = self.model.last_hidden
        return logits

    def run_step(
        self, model_input: SpyreSpecModelInput  # type: ignore[override]
    ) -> Optional[list[SamplerOutput]]:
        out = super().run_step(model_input)
        verified, self._verified = self._verified, None
        if out and model_input.verify is not None:
            assert verified is not None
            out = [self._accept(out[0], model_input, verified)]
        if self.proposer is not None:
            self.proposer.stepped(model_input, out[0].outputs if out else
                                  None, self._hidden)
        self._hidden = [None, None]
        return out

    def _verify(self, step: PagedInputs, loras) -> torch.Tensor:
        assert self.model is not None
        if self.model.lora is not None:
            rows, length = step.input_ids.shape
            self.model.lora.set_step(loras, rows, length, length)
        return self.model.verify(step)

    def _accept(self, first: SamplerOutput, model_input: SpyreSpecModelInput,
                logits: torch.Tensor) -> SamplerOutput:
        """Each decode row's emitted tokens: the first position's from
        ``first`` (the step's sampler output), then position by position
        while the sampled token equals the proposal."""
        assert model_input.proposals is not None
        assert model_input.decode_metas is not None
        offset = len(first.outputs) - len(model_input.proposals)
        emitted = [[g.samples[0]] for g in first.outputs[offset:]]
        alive = [i for i, p in enumerate(model_input.proposals)
                 if p and emitted[i][0].output_token == p[0]]
        position = 1
        while alive:
            metas = [_extended(model_input.decode_metas[i],
                               model_input.proposals[i][:position])
                     for i in alive]
            lens = [only.get_len() for m in metas
                    for only in m.seq_data.values()]
            sm = self.sampling_metadata(metas, lens, [1] * len(metas), None)
            rows = logits[alive, position]
            outs = sample(self.get_model(), rows, sm).outputs
            still = []
            for i, group in zip(alive, outs):
                token = group.samples[0]
                emitted[i].append(token)
                proposals = model_input.proposals[i]
                if position < len(proposals) and \
                        token.output_token == proposals[position]:
                    still.append(i)
            alive, position = still, position + 1
        outputs = list(first.outputs[:offset])
        for i, tokens in enumerate(emitted):
            proposed = len(model_input.proposals[i])
            if proposed:
                request_id = model_input.decode_metas[i].request_id
                self.backoff.verified(request_id, len(tokens) - 1)
                if self.cost is not None:
                    self.cost.verified(request_id, proposed,
                                       len(tokens) - 1)
            outputs.append(
                SpeculativeGroupOutput(samples=tokens, prompt_logprobs=None,
                                       proposed=proposed))
        first.outputs = outputs
        return first


def _extended(meta: SequenceGroupMetadata,
              accepted: tuple[int, ...]) -> SequenceGroupMetadata:
    """``meta`` as the sampler sees it with ``accepted`` appended to its
    output (a copy; the engine's sequence is untouched)."""
    seq_id, data = _seq(meta)
    seen = copy.copy(meta)
    seen.seq_data = {
        seq_id:
        SequenceData.from_seqs(data.get_prompt_token_ids(),
                               [*data.get_output_token_ids(), *accepted])
    }
    return seen
