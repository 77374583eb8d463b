"""SpyreEncoderModel: an FMS encoder (BERT, RoBERTa), compiled with
torch.compile, with vLLM's poolers on top: embeddings and cross-encoder
scores on Spyre.

The pooling model runner calls ``forward`` once per packed pass with the
tensors built by ``vllm.worker.spyre_pooling_inputs`` (``[B, L]`` token
ids, positions and token types, and a ``[B, L, L]`` block-diagonal mask):
the encoder body runs as one compiled graph per warm-up shape and returns
the hidden state of every slot.  The runner gathers the texts' hidden
states and hands them to ``pooler``, vLLM's own ``DispatchPooler``, which
applies the model's pooling type (from its sentence-transformers
configuration, else the architecture's default), normalisation,
``dimensions`` (Matryoshka) and, for cross-encoders, the classification
head and activation, exactly as vLLM's own BERT and RoBERTa models do.

The body is FMS's ``RoBERTaHeadless``, which FMS uses for BERT too; the
checkpoint is read through FMS's ``hf`` adapters (``bert``, ``roberta``
and their ``_classification`` variants), so FMS names, fuses and, under
tensor parallelism, shards the weights.  An architecture FMS lacks
(ModernBERT) runs on the Hugging Face body instead
(``spyre_hf_encoder``), with the same inputs and poolers.
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from torch import nn

from vllm.attention.ops import spyre_encoder_attention as encoder_attention
from vllm.attention.ops.spyre_encoder_attention import (ATTN_NAME, ATTN_NAME_BF16,
                                                    ATTN_NAME_CPU,
                                                    ATTN_NAME_CPU_BF16)
from vllm.compilation.spyre_compile import compile_graphs
from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.logger import init_logger
from vllm.model_executor.layers import spyre_linear
from vllm.model_executor.layers.pooler import (ClassifierPooler, CLSPool,
                                               DispatchPooler, MeanPool,
                                               Pooler)
from vllm.model_executor.model_loader import (
    spyre_encoder_loader as encoder_loader)
from vllm.model_executor.models.spyre_dtypes import encoder_dtype
from vllm.model_executor.models.spyre_encoder_families import (
    HFEncoderFamily, check_parallel, encoder_family)
from vllm.model_executor.models.spyre_hf_encoder import HFEncoder
from vllm.spyre_kernels import ops as native

logger = init_logger(__name__)


class _Encoder(nn.Module):
    """The FMS modules, named as FMS's adapters name the weights."""

    def __init__(self, config, strategy, classify: bool) -> None:
        super().__init__()
        from fms.models.roberta import RoBERTaHeadless
        from fms.modules.head import MLPClassificationHead
        from fms.utils.activation import str_to_activation
        #: The FMS attention op every layer runs.
        self.attn_name = ATTN_NAME
        self.config = config  # FMS's adapters read it
        self.base_model = RoBERTaHeadless(config, strategy)
        if classify:
            self.classification_head = MLPClassificationHead(
                config.emb_dim,
                num_classes=config.num_classes,
                activation_fn=str_to_activation(
                    config.classifier_activation_fn))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor, mask: torch.Tensor,
                text_starts: torch.Tensor) -> torch.Tensor:
        # SDPA reads the mask, the C++ kernel the texts' first slots.
        layout = ({"text_starts": text_starts} if self.attn_name
                  in (ATTN_NAME_CPU, ATTN_NAME_CPU_BF16) else {"mask": mask})
        return self.base_model(input_ids,
                               position_ids=position_ids,
                               token_type_ids=token_type_ids,
                               attn_name=self.attn_name,
                               **layout)


class SpyreEncoderModel(nn.Module):
    """FMS encoder compiled for the configured backend, with vLLM's
    poolers."""

    is_pooling_model = True

    def __init__(self, *, vllm_config: VllmConfig,
                 spyre_config: SpyreConfig) -> None:
        super().__init__()
        self.spyre_config = spyre_config
        model_config = vllm_config.model_config
        #: The dtype of the encoder's tensors, and whether its matrix
        #: products run in bfloat16 (``encoder_dtype``).
        self.dtype, self.bf16_matmuls = encoder_dtype(
            model_config.dtype, spyre_config.dynamo_backend)
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        self.hf_config = model_config.hf_config
        self.family = encoder_family(self.hf_config)
        check_parallel(self.family, self.tp_size)
        #: Position of each text's first token (``packed_inputs``).
        self.first_position = self.family.first_position(self.hf_config)
        if isinstance(self.family, HFEncoderFamily):
            self.encoder = self._load_hf(model_config.model)
        else:
            self.encoder = self._load(model_config.model)
            self._choose_attention(spyre_config.dynamo_backend)
        self.pooler = self._build_pooler(model_config)
        self.model = self._compile(self.encoder)

    def _choose_attention(self, backend: str) -> None:
        """FMS's attention op: SDPA (in bfloat16 under ``--dtype
        bfloat16``), or the C++ kernel on the CPU backends
        (``native.in_use``)."""
        encoder_attention.register()
        if self.bf16_matmuls:
            n = spyre_linear.bf16_linears(self.encoder.base_model)
            self.encoder.attn_name = ATTN_NAME_BF16
            logger.info("Matrix products of %d linear layers and of "
                        "attention in bfloat16", n)
        use, why = native.in_use(backend, self.spyre_config.native_kernels)
        if use:
            self.encoder.attn_name = (ATTN_NAME_CPU_BF16 if self.bf16_matmuls
                                      else ATTN_NAME_CPU)
        logger.info("Spyre native CPU attention kernel %s (%s)",
                    "in use" if use else "not in use", why)

    # ---- load -----------------------------------------------------------
    def _load_hf(self, path: str) -> HFEncoder:
        start = time.perf_counter()
        encoder = HFEncoder(path, self.family, self.dtype)
        if self.bf16_matmuls:
            n = spyre_linear.bf16_linears(encoder)
            logger.info("Matrix products of %d linear layers in bfloat16", n)
        logger.info("Loaded the Hugging Face %s encoder body from %s in "
                    "%.1f s (FMS has no such encoder)",
                    self.family.hf_architecture, path,
                    time.perf_counter() - start)
        return encoder

    def _load(self, path: str) -> _Encoder:
        """The FMS encoder modules, built from the family's configuration
        and filled from the checkpoint (``spyre_encoder_loader``)."""
        start = time.perf_counter()
        config = encoder_loader.fms_encoder_config(self.family, self.hf_config)
        encoder = _Encoder(config, encoder_loader.tp_strategy(self.tp_size),
                           self.family.classify)
        encoder_loader.load_encoder_weights(encoder, path, self.family,
                                            self.dtype, self.tp_size)
        logger.info("Loaded FMS %s encoder from %s in %.1f s",
                    self.family.fms_architecture, path,
                    time.perf_counter() - start)
        return encoder

    def _build_pooler(self, model_config) -> Pooler:
        """vLLM's poolers, by task, as vLLM's BERT and RoBERTa models build
        them."""
        pooler_config = model_config.pooler_config
        if not self.family.classify:
            return DispatchPooler({
                "encode": Pooler.for_encode(pooler_config),
                "embed": Pooler.for_embed(pooler_config),
            })
        if isinstance(self.encoder, HFEncoder):
            head = self.encoder.classify_head(self.dtype)
            pool = (MeanPool if self.encoder.classifier_pooling == "mean"
                    else CLSPool)
        else:
            head, pool = self.classify_head, CLSPool
        return DispatchPooler({
            "encode": Pooler.for_encode(pooler_config),
            "classify": ClassifierPooler(
                pooling=pool(), classifier=head,
                act_fn=ClassifierPooler.act_fn_for_seq_cls(model_config)),
            "score": ClassifierPooler(
                pooling=pool(), classifier=head,
                act_fn=ClassifierPooler.act_fn_for_cross_encoder(
                    model_config)),
        })

    def classify_head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The cross-encoder's head on the first token's hidden state
        (BERT's pooler dense + tanh, RoBERTa's classifier dense + tanh,
        then the output projection): ``[N, H]`` -> ``[N, labels]``."""
        head = self.encoder.classification_head
        return head.head(head.act(head.dense(pooled.to(self.dtype))))

    # ---- compile --------------------------------------------------------
    def _compile(self, encoder: nn.Module) -> Callable:
        """One graph per warm-up shape, as on the card; with ``inductor``
        the weights are frozen into the graphs (large matrix products,
        every token of the batch at once: inductor pre-packs them for
        oneDNN)."""
        limit = max(64, 4 * len(self.spyre_config.warmup_shapes))
        return compile_graphs(encoder, self.spyre_config.dynamo_backend,
                              cache_size_limit=limit, freeze=True)

    @staticmethod
    def graph_name(batch_size: int, prompt_len: int) -> str:
        return f"encode-b{batch_size}-p{prompt_len}"

    def graph_cache_stats(self) -> dict[str, int]:
        """Pooling models compile at every start (no graph cache)."""
        return {}

    # ---- run ------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor, mask: torch.Tensor,
                text_starts: torch.Tensor) -> torch.Tensor:
        """One packed pass: ``[B, L]`` inputs, ``[B, L, L]`` mask and
        ``[B, L]`` first slot of each slot's text -> the hidden state of
        every slot, ``[B * L, H]``."""
        B, L = input_ids.shape
        hidden = self.model(self.graph_name(B, L), input_ids, position_ids,
                            token_type_ids, mask, text_starts)
        return hidden.reshape(B * L, -1)
