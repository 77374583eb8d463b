"""SpyrePoolingModelRunner: embeddings and cross-encoder scores over
compiled shapes.

Each engine step is a set of texts (chosen by ``SpyrePoolingScheduler``)
run in one forward pass of the encoder: ``plan_passes`` packs them into
the cheapest warm-up shape that holds them all (several short texts to a
row), ``SpyreEncoderModel`` returns the hidden state of every slot, and
the texts' own slots, in request order, go to vLLM's pooler, which returns
one ``PoolingSequenceGroupOutput`` per request.  Warm-up runs every shape
once, so serving compiles nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from vllm.config.spyre import WarmupShape
from vllm.logger import init_logger
from vllm.model_executor.models.spyre_encoder import SpyreEncoderModel
from vllm.model_executor.pooling_metadata import PoolingMetadata
from vllm.platforms import current_platform
from vllm.sequence import PoolerOutput, SequenceGroupMetadata
from vllm.worker.spyre_pooling_inputs import (EncoderInputs, Placement,
                                              packed_inputs, plan_passes)
from vllm.worker.spyre_runner_base import (SpyreModelInputBase,
                                           SpyreRunnerBase, only_seq)

logger = init_logger(__name__)


@dataclass(frozen=True)
class SpyrePoolingModelInput(SpyreModelInputBase):
    """The packed passes of one step, built on the driver worker."""

    NESTED = {"passes": (EncoderInputs, )}
    LOCAL = ("pooling_metadata", )

    passes: tuple[EncoderInputs, ...]
    pooling_metadata: Optional[PoolingMetadata] = None


class SpyrePoolingModelRunner(SpyreRunnerBase[SpyrePoolingModelInput]):

    model_cls = SpyreEncoderModel
    input_cls = SpyrePoolingModelInput
    model: Optional[SpyreEncoderModel]  # type: ignore[assignment]

    # ---- start-up -------------------------------------------------------
    def warmup(self) -> None:
        """Compiles every warm-up shape by running it once, every row
        full."""
        self.warm_up_shapes("pooling shape", _describe)

    @current_platform.inference_mode()
    def _run_shape(self, shape: WarmupShape, texts: list[list[int]]) -> None:
        placements = [Placement(row, 0) for row in range(len(texts))]
        self._encode(self._inputs(texts, [None] * len(texts), shape,
                                  placements))

    # ---- per step -------------------------------------------------------
    def prepare_model_input(
        self,
        seq_group_metadata_list: list[SequenceGroupMetadata],
        virtual_engine: int = 0,
        finished_requests_ids: Optional[list[str]] = None,
    ) -> SpyrePoolingModelInput:
        texts = [only_seq(m).prompt_token_ids
                 for m in seq_group_metadata_list]
        types = [m.token_type_ids for m in seq_group_metadata_list]
        passes = []
        for shape, indices, placements in plan_passes(
                [len(t) for t in texts], self.spyre_config.warmup_shapes):
            passes.append(
                self._inputs([texts[i] for i in indices],
                             [types[i] for i in indices], shape, placements))
        return SpyrePoolingModelInput(
            passes=tuple(passes),
            pooling_metadata=self._pooling_metadata(seq_group_metadata_list,
                                                    [len(t) for t in texts]))

    def _inputs(self, texts, types, shape: WarmupShape,
                placements) -> EncoderInputs:
        assert self.model is not None
        return packed_inputs(texts, types, shape, placements, self.pad_id,
                             self.model.first_position)

    def _pooling_metadata(self, metas: list[SequenceGroupMetadata],
                          prompt_lens: list[int]) -> PoolingMetadata:
        """vLLM's V0 pooling metadata, with each request's parameters
        updated for its task as vLLM's own pooling runner does."""
        assert self.model is not None
        seq_groups = []
        seq_data = {}
        for meta in metas:
            params = meta.pooling_params
            if params is None or params.task is None:
                raise ValueError(
                    f"request {meta.request_id} has no pooling task")
            self.model.pooler.get_pooling_updates(params.task).apply(params)
            seq_groups.append((list(meta.seq_data), params))
            seq_data.update(meta.seq_data)
        return PoolingMetadata(seq_groups=seq_groups,
                               seq_data=seq_data,
                               prompt_lens=prompt_lens)

    def run_step(
        self, model_input: SpyrePoolingModelInput
    ) -> Optional[list[PoolerOutput]]:
        # Passes hold consecutive runs of the step's texts, in order.
        hidden = torch.cat([self._encode(p) for p in model_input.passes])
        if model_input.pooling_metadata is None:
            return []  # a non-driver rank: the driver pools
        assert self.model is not None
        return [self.model.pooler(hidden, model_input.pooling_metadata)]

    def _encode(self, inputs: EncoderInputs) -> torch.Tensor:
        """The hidden states of the pass's texts, concatenated:
        ``[tokens, H]``."""
        assert self.model is not None
        hidden = self.model(inputs.input_ids, inputs.position_ids,
                            inputs.token_type_ids, inputs.mask,
                            inputs.text_starts)
        return hidden[inputs.gather]


def _describe(shape: WarmupShape) -> str:
    return f"(prompt_len={shape.prompt_len}, batch_size={shape.batch_size})"
