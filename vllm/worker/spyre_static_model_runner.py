"""SpyreStaticModelRunner: static batching over compiled shapes.

A batch starts with a prefill step (every request of the batch, padded to
one warm-up shape) and continues with decode steps until the scheduler
stops sending its requests.  The runner remembers which row each request
occupies; a request that finishes or is aborted simply stops appearing,
its row keeps computing padding, and its logits are never sampled.

``execute_model`` is the whole step: prepared inputs -> ``SpyreStaticCausalLM``
forward -> live rows -> vLLM logits processor -> vLLM sampler.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig, WarmupShape
from vllm.core.spyre_static_shapes import RequestSize, choose_shape
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.lora.spyre_lora import StepAdapters, step_adapters
from vllm.model_executor.layers.sampler import SamplerOutput
from vllm.model_executor.models.spyre_static_causal_lm import (
    SpyreStaticCausalLM)
from vllm.model_executor.sampling_metadata import SamplingMetadata
from vllm.platforms import current_platform
from vllm.sequence import SequenceGroupMetadata
from vllm.worker import spyre_image_inputs as image_inputs
from vllm.worker import spyre_prompt_logprobs as prompt_logprobs
from vllm.worker.spyre_runner_base import (SpyreModelInputBase,
                                           SpyreRunnerBase, only_seq, sample)
from vllm.worker.spyre_static_inputs import (DecodeSteps, StepInputs,
                                             prefill_inputs)

logger = init_logger(__name__)


@dataclass(frozen=True)
class SpyreStaticModelInput(SpyreModelInputBase):
    """Everything one step needs, built on the driver worker."""

    NESTED = {"inputs": StepInputs, "prefill_image_tensors": dict}
    LOCAL = ("sampling_metadata", )

    is_prompt: bool
    inputs: StepInputs
    live_rows: torch.Tensor  # [N] rows to sample, in request order
    sampling_metadata: Optional[SamplingMetadata] = None
    #: A prefill's rows asking for prompt log-probabilities, ``[K, 3]``:
    #: row, prompt length, how many top tokens (``spyre_prompt_logprobs``);
    #: None when none asks, and then not broadcast.
    logprob_rows: Optional[torch.Tensor] = None
    #: With ``--enable-lora``: the adapters of the step's requests and the
    #: lora id of every row (0: none, and for rows not in the step).
    lora_requests: Optional[tuple[LoRARequest, ...]] = None
    lora_ids: Optional[tuple[int, ...]] = None
    #: A prefill's requests with images: each one's row and prompt
    #: length, ``[K, 2]``, and their tensors (``spyre_image_inputs``).
    prefill_image_rows: Optional[torch.Tensor] = None
    prefill_image_tensors: Optional[dict[str, torch.Tensor]] = None


@dataclass
class _Batch:
    """Row bookkeeping of the batch now running (driver only)."""

    shape: WarmupShape
    decode: DecodeSteps  # masks, positions and slots of every decode step
    last_tokens: list[int]  # per row
    row_of: dict[str, int] = field(default_factory=dict)
    step: int = 0


class SpyreStaticModelRunner(SpyreRunnerBase[SpyreStaticModelInput]):

    model_cls = SpyreStaticCausalLM
    input_cls = SpyreStaticModelInput
    runs_vllm_model_code = True

    def __init__(self, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__(vllm_config, spyre_config)
        self.batch: Optional[_Batch] = None

    # ---- start-up -------------------------------------------------------

    def warmup(self) -> None:
        """Compiles every warm-up shape by running exactly the sequence of
        forward calls a batch of that shape runs while serving: one prefill
        and ``new_tokens - 1`` decode steps."""
        assert self.model is not None
        self.model.require_precompiled()
        self.warm_up_shapes("shape", str)

    @current_platform.inference_mode()
    def _run_shape(self, shape: WarmupShape, prompts: list[list[int]]):
        assert self.model is not None
        window = self.model_facts.sliding_window
        step = prefill_inputs(prompts, shape, self.pad_id, window)
        logits = self._forward(True, step)
        decode = DecodeSteps([len(p) for p in prompts], shape, window)
        for i in range(1, shape.new_tokens):
            tokens = logits.argmax(dim=-1).tolist()
            logits = self._forward(False, decode.inputs(tokens, i))

    # ---- per step -------------------------------------------------------
    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        virtual_engine: int = 0,
        finished_requests_ids: Optional[list[str]] = None,
    ) -> SpyreStaticModelInput:
        is_prompt = seq_group_metadata_list[0].is_prompt
        if any(m.is_prompt != is_prompt for m in seq_group_metadata_list):
            raise RuntimeError("a Spyre step is all prefill or all decode")
        metas = seq_group_metadata_list
        logprob_rows = None
        images = {}
        if is_prompt:
            inputs, rows, seq_lens = self._start_batch(metas)
            if self.get_model().code.embeds_prompts:
                images = image_inputs.static_prefill(metas)
            asking = prompt_logprobs.wanted(metas)
            if asking:
                logprob_rows = torch.tensor(
                    [(rows[i], seq_lens[i],
                      metas[i].sampling_params.prompt_logprobs)
                     for i in asking], dtype=torch.long)
                metas = prompt_logprobs.for_sampler(metas, asking)
        else:
            inputs, rows = self._continue_batch(metas)
            seq_lens = None
        loras = {}
        if self.lora_config is not None:
            ids = [0] * inputs.input_ids.shape[0]
            for row, m in zip(rows, seq_group_metadata_list):
                ids[row] = m.lora_int_id
            loras = dict(lora_requests=step_adapters(metas),
                         lora_ids=tuple(ids))
        return SpyreStaticModelInput(
            is_prompt=is_prompt,
            inputs=inputs,
            live_rows=torch.tensor(rows, dtype=torch.long),
            sampling_metadata=self.sampling_metadata(metas, seq_lens,
                                                     seq_lens,
                                                     finished_requests_ids),
            logprob_rows=logprob_rows,
            **loras, **images)

    def _start_batch(self, metas: list[SequenceGroupMetadata]):
        prompts = [only_seq(m).prompt_token_ids for m in metas]
        sizes = [
            RequestSize(len(p), m.sampling_params.max_tokens or 0)
            for p, m in zip(prompts, metas)
        ]
        shape = choose_shape(sizes, self.spyre_config.warmup_shapes)
        if shape is None:
            raise RuntimeError(
                f"no compiled shape holds this batch of {len(sizes)} "
                f"requests {sizes}; the scheduler should not have formed it")
        window = self.model_facts.sliding_window
        inputs = prefill_inputs(prompts, shape, self.pad_id, window)
        pad_rows = shape.batch_size - len(prompts)
        self.batch = _Batch(
            shape=shape,
            decode=DecodeSteps([len(p) for p in prompts] + [1] * pad_rows,
                               shape, window),
            last_tokens=[self.pad_id] * shape.batch_size,
            row_of={m.request_id: i for i, m in enumerate(metas)})
        seq_lens = [len(p) for p in prompts]
        return inputs, list(range(len(metas))), seq_lens

    def _continue_batch(self, metas: list[SequenceGroupMetadata]):
        batch = self.batch
        if batch is None:
            raise RuntimeError("decode step without a running batch")
        batch.step += 1
        if batch.step >= batch.shape.new_tokens:
            raise RuntimeError(
                f"decode step {batch.step} exceeds shape {batch.shape}")
        rows = []
        for m in metas:
            row = batch.row_of[m.request_id]
            batch.last_tokens[row] = only_seq(m).get_last_token_id()
            rows.append(row)
        return batch.decode.inputs(batch.last_tokens, batch.step), rows

    def run_step(
        self, model_input: SpyreStaticModelInput
    ) -> Optional[list[SamplerOutput]]:
        embeds = None
        if model_input.prefill_image_rows is not None:
            embeds = image_inputs.static_embeds(
                self.get_model().code, model_input.inputs.input_ids,
                model_input.prefill_image_rows,
                model_input.prefill_image_tensors or {})
        logits = self._forward(model_input.is_prompt, model_input.inputs,
                               _adapters(model_input), embeds)
        computed = self._prompt_logprobs(model_input)
        if model_input.sampling_metadata is None:
            return []  # a non-driver rank: the driver samples
        logits = logits[model_input.live_rows]  # [N, vocab]
        return [prompt_logprobs.attach(
            sample(self.get_model(), logits, model_input.sampling_metadata),
            computed)]

    def _prompt_logprobs(self, model_input: SpyreStaticModelInput) -> dict:
        """The prompt log-probabilities of the prefill rows that ask
        (``spyre_prompt_logprobs``), keyed by their place among the live
        rows; run on every rank."""
        if model_input.logprob_rows is None:
            return {}
        assert self.model is not None
        ids = model_input.inputs.input_ids
        live = model_input.live_rows.tolist()
        computed = {}
        for row, n, k in model_input.logprob_rows.tolist():
            if self.model.lora is not None:
                adapters, lora_ids = _adapters(model_input)
                self.model.lora.one_sequence(adapters, lora_ids[row], n)
            computed[live.index(row)] = prompt_logprobs.compute(
                self.model, ids[row, ids.shape[1] - n:], k)
        return computed

    def _forward(self, is_prompt: bool, step: StepInputs,
                 loras: Optional[StepAdapters] = None,
                 embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One forward of ``step``; ``loras``: the step's adapters and
        every row's lora id (``spyre_lora``); ``embeds``: a prefill's
        embeddings with its images."""
        assert self.model is not None
        if self.model.lora is not None:
            self.model.lora.set_step(loras, *step.input_ids.shape)
        return self.model(step.input_ids, step.position_ids, step.mask,
                          step.cache_slots, step.cache_len, is_prompt,
                          embeds)


def _adapters(model_input: SpyreStaticModelInput) -> StepAdapters:
    return (model_input.lora_requests or (), model_input.lora_ids or ())
