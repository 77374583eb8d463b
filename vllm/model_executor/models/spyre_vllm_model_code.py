"""vLLM's own model code in a Spyre decoder (``--model-impl vllm``): the
RFC's P5.

The same Spyre LMs (``SpyreStaticCausalLM``, ``SpyreCBCausalLM``) run it
as they run FMS's, with the same step inputs, caches, warm-up and graphs.
What differs is the model inside:

* vLLM's model class, loaded by vLLM's loader (``spyre_vllm_loader``), its
  linear layers moved to the packed CPU kernels (``spyre_linear_method``);
* its ``Attention`` layers on the Spyre attention backend (``spyre_attn``),
  each called as an ``InlineAttention``: the compiled module's forward
  takes the step's tensors and the caches as inputs and hands them to its
  layers (``AttentionStep``), so the Spyre cache ops and kernels run
  inside the graph, as they do for FMS;
* the compiled part (``_LastHidden``) returns each row's last hidden
  state; vLLM's ``compute_logits`` (its output head, the gather of a
  vocabulary split over tensor-parallel ranks, the model's logit scale)
  runs after it.

The caches are the FMS path's (``spyre_kv_layout``): one per static
warm-up shape, or the block pool, each layer's ``(keys, values)`` pair
given to the compiled module with every step.  The step's metadata is also
vLLM's forward context, for any layer of vLLM's that reads it.
"""
from __future__ import annotations

import time
from typing import Optional

import torch
from torch import nn

from vllm.attention.backends.spyre_attn import (CAUSAL, AttentionStep,
                                               SpyreAttentionMetadata,
                                               SpyreAttentionMetadataBuilder,
                                               inline_attention)
from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger
from vllm.lora.spyre_lora import SpyreLoRA
from vllm.model_executor.layers.quantization.spyre_quant import (
    SpyreQuantConfig, finish_quantized_layers)
from vllm.model_executor.layers.spyre_linear_method import use_spyre_linears
from vllm.model_executor.layers.spyre_vllm_fused_ops import use_kernel_ops
from vllm.model_executor.model_loader.spyre_vllm_loader import (
    load_vllm_decoder)
from vllm.model_executor.models.spyre_model_code import ModelCode

logger = init_logger(__name__)


class _LastHidden(nn.Module):
    """What is compiled: vLLM's model over a step of ``[B, L]`` token ids
    (flattened, as vLLM's models take them), attending in the step the
    other inputs describe (``AttentionStep.begin``), returning each row's
    last hidden state, ``[B, hidden]`` (its last ``last_n``, ``[B *
    last_n, hidden]``, for a speculative verify step)."""

    def __init__(self, model: nn.Module, step: AttentionStep) -> None:
        super().__init__()
        self.vllm_model = model
        self.step = step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                caches: list, kind: str, mask: Optional[torch.Tensor],
                cache_slots: torch.Tensor,
                block_table: Optional[torch.Tensor],
                ctx_lens: Optional[torch.Tensor],
                last_n: int = 1,
                inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        rows, length = input_ids.shape
        self.step.begin(kind, rows, length, caches, mask, cache_slots,
                        block_table, ctx_lens)
        extra = ({} if inputs_embeds is None else
                 {"inputs_embeds": inputs_embeds.flatten(0, 1)})
        hidden = self.vllm_model(input_ids.flatten(), positions.flatten(),
                                 **extra)
        self.step.end()
        if last_n == 1:
            return hidden.view(rows, length, -1)[:, -1]
        return hidden.view(rows, length, -1)[:, -last_n:].flatten(0, 1)


class VllmModelCode(ModelCode):
    """vLLM's model class (``vllm_model``), its attention inlined."""

    name = "vLLM"
    #: Each graph is whole: its attention layers read the step from one
    #: ``AttentionStep``, and dynamo, which keeps no guards on the modules
    #: (``compile_graphs``), would run every layer's split-off code with
    #: the first layer's cache.
    whole_graphs = True

    def build(self) -> nn.Module:
        vllm_config = self.vllm_config
        round_inputs = self.precision.linear == torch.bfloat16
        if isinstance(vllm_config.quant_config, SpyreQuantConfig):
            vllm_config.quant_config.finish_on_load(self.native,
                                                    round_inputs)
        self.vllm_model = load_vllm_decoder(vllm_config,
                                            self.precision.model)
        logger.info("Spyre model implementation: vLLM (%s)",
                    type(self.vllm_model).__name__)
        self.attn_name = "vllm-" + ("kernel" if self.native else "torch")
        quantized = finish_quantized_layers(self.vllm_model, self.native,
                                            round_inputs=round_inputs)
        if quantized:
            logger.info(
                "%d quantized linear layers (%s) on the %s, each put there "
                "as it was loaded", quantized,
                vllm_config.quant_config.describe(),
                "quantized CPU kernel" if self.native else
                "float32 products (dequantized once)")
        # Under eager, each layer's cache write and attention in one call
        # (inductor fuses the ops between them itself).
        self.fused_attention = (self.native and
                                self.spyre_config.dynamo_backend == "eager")
        self.step = AttentionStep(on_kernel=self.native,
                                  fused=self.fused_attention)
        start = time.perf_counter()
        moved = use_spyre_linears(self.vllm_model, self.precision.linear,
                                  self.native)
        if moved:
            logger.info("Moved %d linear layers to the %s in %.1f s", moved,
                        "packed CPU kernel" if self.native else
                        "bfloat16 products", time.perf_counter() - start)
        if self.native and self.spyre_config.dynamo_backend == "eager":
            # inductor fuses these ops itself.
            logger.info("RMS norms (%d), rotary embeddings (%d) and gated "
                        "activations (%d) on the CPU kernels",
                        *use_kernel_ops(self.vllm_model))
        if vllm_config.lora_config is not None:
            # After the linear layers moved: each LoRA layer calls its base
            # layer's (packed) method.
            sched = vllm_config.scheduler_config
            self.lora = SpyreLoRA(
                vllm_config, self.vllm_model,
                max([s.batch_size * s.prompt_len
                     for s in self.spyre_config.warmup_shapes] +
                    [sched.max_model_len, sched.max_num_seqs,
                     sched.max_num_batched_tokens]),
                self.native)
        from vllm.model_executor.models.interfaces import supports_multimodal
        self.embeds_prompts = supports_multimodal(self.vllm_model)
        self.attention_layers = inline_attention(self.vllm_model, self.step)
        if not self.attention_layers:
            raise ValueError(f"{type(self.vllm_model).__name__} has no "
                             "attention layers")
        for layer in self.attention_layers:
            # The model's sliding window where vLLM gave the layer none
            # (the platform clears vLLM's own window setting).
            layer.impl.use_model_window(self.window)
        impl = self.attention_layers[0].impl
        self.cache_layout = CacheLayout(layers=len(self.attention_layers),
                                        kv_heads=impl.num_kv_heads,
                                        k_head_dim=impl.head_size,
                                        v_head_dim=impl.head_size)
        self.metadata = SpyreAttentionMetadataBuilder(
            on_kernel=self.native, fused=self.fused_attention)
        return _LastHidden(self.vllm_model, self.step)

    def _run(self, graphs, graph: str, input_ids: torch.Tensor,
             positions: torch.Tensor, caches: list,
             meta: SpyreAttentionMetadata, last_n: int = 1,
             inputs_embeds: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The compiled module on the step ``meta`` describes (also vLLM's
        forward context), then vLLM's logits: ``[B, vocab]`` (``[B,
        last_n, vocab]`` for more than the last position)."""
        extra = {"last_n": last_n} if last_n > 1 else {}
        if inputs_embeds is not None:
            extra["inputs_embeds"] = inputs_embeds
        with set_forward_context(meta, self.vllm_config):
            hidden = graphs(graph, input_ids, positions, caches, meta.kind,
                            meta.mask, meta.cache_slots, meta.block_table,
                            meta.ctx_lens, **extra)
        logits = self.vllm_model.compute_logits(hidden, None)
        if self.keeps_hidden:
            self.last_hidden = (hidden if last_n == 1 else hidden.view(
                input_ids.shape[0], last_n, -1))
        if last_n == 1:
            return logits
        return logits.view(input_ids.shape[0], last_n, -1)

    def static_step(self, graphs, graph, input_ids, positions, caches, mask,
                    cache_slots, is_prompt, inputs_embeds=None):
        self.metadata.static(input_ids, mask, cache_slots, is_prompt)
        return self._run(graphs, graph, input_ids, positions, caches,
                         self.metadata.build([], [], 0, input_ids.shape[0]),
                         inputs_embeds=inputs_embeds)

    def paged_step(self, graphs, graph, step: PagedInputs, caches, window,
                   last_n: int = 1):
        self.metadata.paged(step)
        return self._run(graphs, graph, step.input_ids, step.position_ids,
                         caches,
                         self.metadata.build([], [], 0,
                                             step.input_ids.shape[0]),
                         last_n, step.inputs_embeds)

    # ---- images ---------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.vllm_model.get_input_embeddings(ids.flatten()).view(
            *ids.shape, -1)

    def prompt_embeds(self, token_ids: torch.Tensor,
                      images: dict) -> torch.Tensor:
        """vLLM's vision tower and projector on the request's images
        (``get_multimodal_embeddings``), merged at their placeholders
        (``get_input_embeddings``); run eagerly, once per prefill."""
        features = self.vllm_model.get_multimodal_embeddings(**images)
        return self.vllm_model.get_input_embeddings(token_ids, features)

    # ---- prompt log-probabilities -----------------------------------------
    def prompt_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """Attention causal over the prompt, uncompiled, no cache."""
        self.metadata.causal(ids.shape[1])
        meta = self.metadata.build([], [], 0, 1)
        self.step.begin(CAUSAL, 1, ids.shape[1])
        try:
            with set_forward_context(meta, self.vllm_config):
                hidden = self.vllm_model(ids[0], torch.arange(ids.shape[1]))
        finally:
            self.step.end()
        return hidden.unsqueeze(0)

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """vLLM's logits (head, gather, logit scale)."""
        if self.lora is not None:
            self.lora.sequence_rows(hidden.shape[1])
        return self.vllm_model.compute_logits(hidden[0], None).float()

    def update_weights_in_place(self, state_dict, frozen: bool) -> int:
        raise NotImplementedError(
            "In-place weight updates are not supported on Spyre with "
            "--model-impl vllm: they load into FMS's model code "
            "(--model-impl auto, for an architecture FMS has)")
