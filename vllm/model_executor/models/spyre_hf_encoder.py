"""Encoders FMS does not implement, run on the Hugging Face encoder body.

FMS has BERT and RoBERTa (``spyre_encoder_families.ENCODER_FAMILIES``).
For a pooling architecture that vLLM registers and transformers implements
but FMS does not, the encoder body is the transformers model itself, loaded
from the checkpoint and compiled with the configured backend like FMS's.
Today that is ModernBERT's cross-encoder and classifier,
``ModernBertForSequenceClassification`` (rerankers such as
gte-reranker-modernbert).  vLLM 0.10.1.1 does not register the bare
``ModernBertModel`` as a pooling model, so it refuses a ModernBERT
embedder itself, before any platform code runs.  Texts are packed as for
FMS: ``HFEncoder.forward`` calls the body's embedding, layers and final
norm with additive masks of its own, built from the same block-diagonal mask, so that every text
attends to its own tokens only, and its positions (which drive ModernBERT's
rotary embedding) restart at 0.  ModernBERT's local-attention layers see
only tokens within half their window on either side: the band is applied
to slot distances, which within one text are token distances.

What this path does not do: tensor parallelism (the body is not sharded;
refused at start-up) and the C++ attention kernel (the body runs its own
SDPA).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from vllm.model_executor.models.spyre_encoder_families import HFEncoderFamily


class HFEncoder(nn.Module):
    """A transformers ModernBERT body (and head), called on packed rows."""

    def __init__(self, path: str, family: HFEncoderFamily,
                 dtype: torch.dtype) -> None:
        super().__init__()
        import transformers
        cls = getattr(transformers, family.hf_architecture)
        # reference_compile: ModernBERT's own torch.compile of parts of the
        # body; the whole pass is compiled here instead.
        model = cls.from_pretrained(path, dtype=dtype,
                                    attn_implementation="sdpa",
                                    reference_compile=False)
        model.eval()
        model.requires_grad_(False)
        self.config = model.config
        self.body = model.model if family.classify else model
        if family.classify:
            self.prediction_head = model.head
            self.classifier = model.classifier
        #: Slots either side a local-attention layer sees.
        self.half_window = self.config.local_attention // 2

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor, mask: torch.Tensor,
                text_starts: torch.Tensor) -> torch.Tensor:
        """``[B, L]`` packed inputs and ``[B, L, L]`` mask -> ``[B, L, H]``
        hidden states (ModernBERT has no token types)."""
        body = self.body
        L = input_ids.shape[1]
        floor = torch.finfo(body.dtype).min
        slots = torch.arange(L, device=input_ids.device)
        near = (slots[:, None] - slots[None, :]).abs() <= self.half_window
        everywhere = torch.zeros(mask.shape, dtype=body.dtype).masked_fill(
            ~mask, floor).unsqueeze(1)
        nearby = everywhere.masked_fill(~near, floor)
        hidden = body.embeddings(input_ids=input_ids)
        for layer in body.layers:
            hidden = layer(hidden, attention_mask=everywhere,
                           sliding_window_mask=nearby,
                           position_ids=position_ids)[0]
        return body.final_norm(hidden)

    def classify_head(self, dtype: torch.dtype) -> Callable:
        """The cross-encoder's head on a pooled hidden state: ``[N, H]`` ->
        ``[N, labels]`` (prediction head, then classifier)."""
        def apply(pooled: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.prediction_head(pooled.to(dtype)))

        return apply

    @property
    def classifier_pooling(self) -> str:
        """How the cross-encoder pools a text: ``"cls"`` or ``"mean"``."""
        return self.config.classifier_pooling
