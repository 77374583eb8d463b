"""FMS's model code in a Spyre decoder (``--model-impl auto`` where FMS
has the architecture).

The model is loaded by
``vllm.model_executor.model_loader.spyre_fms_loader``, put on the
project's CPU kernels (or on oneDNN's bfloat16 products without them) and
given the LM's attention ops; the compiled module is the FMS model itself,
called with FMS's ``forward`` arguments and the Spyre attention op's.
"""
from __future__ import annotations

import time

import torch
from fms.utils.headless import gather_outputs
from torch import nn

from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.attention.ops.spyre_torch_ops import causal_mask
from vllm.logger import init_logger
from vllm.model_executor.layers import (spyre_fused_ops, spyre_linear,
                                        spyre_mamba)
from vllm.model_executor.model_loader import spyre_weight_update
from vllm.model_executor.model_loader import (
    spyre_fms_loader as spyre_loader)
from vllm.model_executor.models import spyre_families
from vllm.model_executor.models.spyre_model_code import ModelCode

logger = init_logger(__name__)


class FmsModelCode(ModelCode):
    """An FMS decoder (``fms_model``), on the CPU kernels."""

    name = "FMS"

    def build(self) -> nn.Module:
        """Loads the FMS model, puts it on the kernels or oneDNN, registers
        its attention ops and reads its cache layout; returns the module to
        compile."""
        model_config = self.vllm_config.model_config
        self.fms_model = spyre_loader.load_fms_decoder(
            model_config.model, model_config.hf_config, self.precision,
            self.tp_size, self.spyre_config.dynamo_backend,
            packed=self.native)
        logger.info("Spyre model implementation: FMS (%s)",
                    type(self.fms_model).__name__)
        self.attn_name = self.attention.ATTN_NAME
        if self.native:
            self._use_cpu_kernels()
        else:
            self._bf16_products()
        # Linear layers read in a narrower dtype that neither took.
        spyre_linear.widen_linears(self.fms_model, self.precision.model)
        self.attention.register()
        self.cache_layout = CacheLayout.of(self.fms_model)
        self.state_layout = spyre_mamba.StateLayout.of(self.fms_model)
        self.is_ssm = (spyre_mamba.layer_kinds(self.fms_model)
                       if self.state_layout else [])
        if self.keeps_hidden:
            return _WithHidden(self.fms_model)
        return self.fms_model

    def _use_cpu_kernels(self) -> None:
        """The CPU backends: linear layers go to the packed CPU kernel
        (``spyre_linear``), their weights packed in ``precision.linear``,
        and attention to its companion kernel.  Under ``eager``, which
        fuses nothing, the norms and rotary embeddings run on kernels too
        (``spyre_fused_ops``); ``inductor`` fuses them itself."""
        start = time.perf_counter()
        n = spyre_linear.pack_linears(self.fms_model, self.precision.linear)
        self.attn_name = self.attention.ATTN_NAME_CPU_KERNEL
        if self.spyre_config.dynamo_backend == "eager":
            # Each layer's cache write and attention in two calls (inductor
            # fuses the ops between them itself).
            self.attn_name = self.attention.ATTN_NAME_EAGER_KERNEL
        logger.info("Packed the weights of %d linear layers in %s in %.1f s",
                    n, str(self.precision.linear).removeprefix("torch."),
                    time.perf_counter() - start)
        if self.spyre_config.dynamo_backend == "eager":
            norms, rotaries = spyre_fused_ops.use_fused_ops(self.fms_model)
            logger.info("Norms (%d) and rotary embeddings (%d) on the CPU "
                        "kernels", norms, rotaries)

    def _bf16_products(self) -> None:
        """bfloat16 products under a float32 model off the kernels
        (``VLLM_SPYRE_NATIVE_KERNELS=0``, or no C++ compiler): through
        oneDNN (``Bf16Linear``, whose outputs are rounded to bfloat16)."""
        if self.precision.linear != torch.bfloat16 or \
                self.precision.model == torch.bfloat16:
            return
        spyre_linear.bf16_linears(self.fms_model)

    # ---- steps ------------------------------------------------------------
    def static_step(self, graphs, graph, input_ids, positions, caches, mask,
                    cache_slots, is_prompt):
        logits, _ = graphs(
            graph,
            input_ids,
            position_ids=positions,
            past_key_value_states=caches,
            use_cache=True,
            last_n_tokens=1,
            mask=mask,
            attn_name=self.attn_name,
            cache_slots=cache_slots,
            spyre_prefill=is_prompt,
        )
        return logits[:, -1, :]

    def paged_step(self, graphs, graph, step: PagedInputs, caches, window,
                   last_n: int = 1):
        out, _ = graphs(
            graph,
            step.input_ids,
            position_ids=step.position_ids,
            past_key_value_states=caches,
            use_cache=True,
            last_n_tokens=last_n,
            attn_name=self.attn_name,
            cache_slots=step.cache_slots,
            block_table=step.block_table,
            ctx_lens=step.ctx_lens,
            spyre_window=window,
        )
        if self.keeps_hidden:
            out, hidden = out
            self.last_hidden = (hidden[:, -1, :] if last_n == 1 else
                                hidden[:, -last_n:, :])
        return out[:, -1, :] if last_n == 1 else out[:, -last_n:, :]

    # ---- prompt log-probabilities (``spyre_prompt_logprobs``) -----------
    def prompt_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        window = self.window
        # FMS's attention is causal over the whole prompt; a sliding window
        # needs its own mask.
        mask = {"mask": causal_mask(length, window)} if window else {}
        hidden, _ = self.fms_model.base_model(
            ids, torch.arange(length).unsqueeze(0), None, False, **mask)
        return hidden

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.fms_model.head(hidden)[0].float()
        scale = getattr(self.fms_model.config, "logits_scaling", 1.0)
        return logits / scale if scale != 1.0 else logits

    # ---- weights ---------------------------------------------------------
    def update_weights_in_place(self, state_dict, frozen: bool) -> int:
        """Loads new weights (Hugging Face naming, full tensors; this rank
        keeps its shard) into the compiled model without recompiling
        (``spyre_weight_update``); returns how many tensors were loaded.
        A state dict that does not match the checkpoint is refused with the
        old weights kept."""
        hf_config = self.vllm_config.model_config.hf_config
        family = spyre_families.family_of(hf_config)
        if self.spyre_config.dynamo_backend == "sendnn":
            raise NotImplementedError(
                "In-place weight updates with the sendnn backend are not "
                "supported on Spyre")
        if not family.serves_checkpoint_layout:
            raise NotImplementedError(
                f"In-place weight updates of {family.hf_architecture} "
                "models are not supported on Spyre")
        if frozen:
            raise NotImplementedError(
                "In-place weight updates of a model compiled with its "
                "weights frozen into the graphs (inductor freezing) are not "
                "supported on Spyre: start the engine with "
                "VLLM_SPYRE_INDUCTOR_FREEZING=0 (or the graph cache on, "
                "TORCH_SENDNN_CACHE_ENABLE=1), which keep the weights graph "
                "inputs")
        layout = spyre_weight_update.CheckpointLayout.read(
            self.vllm_config.model_config.model, hf_config)
        spyre_weight_update.check_state_dict(state_dict, layout)
        return spyre_weight_update.load_in_place(
            self.fms_model, state_dict, layout,
            architecture=family.fms_architecture, source=family.source,
            tensor_parallel=self.tp_size > 1)


class _WithHidden(nn.Module):
    """What is compiled where the hidden states are kept (an MLP
    speculator proposes from them): the FMS model's forward, its head
    included, returning ``((logits, hidden), cache)``."""

    def __init__(self, fms_model: nn.Module) -> None:
        super().__init__()
        self.fms_model = fms_model
        self.scale = getattr(fms_model.config, "logits_scaling", 1.0)

    def forward(self, x: torch.Tensor, position_ids=None,
                past_key_value_states=None, use_cache: bool = False,
                last_n_tokens: int = 0, **attn_kwargs):
        hidden, cache = self.fms_model.base_model(
            x, position_ids, past_key_value_states, use_cache, **attn_kwargs)
        hidden = gather_outputs(hidden, last_n_tokens, **attn_kwargs)
        logits = self.fms_model.head(hidden)
        if self.scale != 1.0:
            logits = logits / self.scale
        return (logits, hidden), cache
