"""The model code inside a Spyre decoder: FMS's or vLLM's own.

A Spyre causal LM is composed of three parts: its model code (this
module's ``ModelCode``: ``spyre_fms_model_code.FmsModelCode`` or
``spyre_vllm_model_code.VllmModelCode``), its cache (one per static
warm-up shape, ``SpyreStaticCausalLM``, or the block pool of continuous
batching, ``SpyreCBCausalLM``) and its compiled graphs
(``vllm.compilation.spyre_compile``).  The model code builds the module
that is compiled, runs one step of it on the caches the LM hands over, and
answers what only it knows: the attention op's name, the cache's geometry,
a whole prompt's hidden states and logits, in-place weight updates.

``spyre_causal_lm.model_code_for`` picks the code
``SpyreModelFacts.model_impl`` names.
"""
from __future__ import annotations

from types import ModuleType
from typing import Optional

import torch
from torch import nn

from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.config import VllmConfig
from vllm.config.spyre import SpyreConfig
from vllm.config.spyre_model_facts import SpyreModelFacts
from vllm.lora.spyre_lora import SpyreLoRA
from vllm.model_executor.layers import spyre_mamba
from vllm.model_executor.models.spyre_dtypes import Precision


class ModelCode(nn.Module):
    """One decoder's model code; ``build`` returns the module to compile,
    whose weights this module holds."""

    #: How the log and the probes name the code.
    name = ""
    #: Whether a break in a graph is an error (``compile_graphs``'s
    #: ``fullgraph``) where the graph cache is off.
    whole_graphs = False

    def __init__(self, vllm_config: VllmConfig, spyre_config: SpyreConfig,
                 precision: Precision, native: bool,
                 attention: ModuleType) -> None:
        """``attention``: the FMS attention ops of the LM's cache
        (``spyre_static_cache`` or ``spyre_paged_cache``), with their
        ``ATTN_NAME``, ``ATTN_NAME_CPU_KERNEL``, ``ATTN_NAME_EAGER_KERNEL``
        and ``register``."""
        super().__init__()
        self.vllm_config = vllm_config
        self.spyre_config = spyre_config
        self.precision = precision
        self.native = native
        self.attention = attention
        self.tp_size = vllm_config.parallel_config.tensor_parallel_size
        #: The sliding window of the model's attention (0: none).
        self.window = SpyreModelFacts.from_vllm_config(
            vllm_config).sliding_window
        #: The attention op of every forward, in the graph cache's key.
        self.attn_name = ""
        #: Every attention layer's cache geometry.
        self.cache_layout: Optional[CacheLayout] = None
        #: A hybrid model's Mamba-2 state geometry (None without such
        #: layers) and which of its layers they are (``spyre_mamba``).
        self.state_layout: Optional[spyre_mamba.StateLayout] = None
        self.is_ssm: list[bool] = []
        #: The LoRA adapters (``--enable-lora``; vLLM's model code only).
        self.lora: Optional[SpyreLoRA] = None
        spec = vllm_config.speculative_config
        #: Whether a continuous-batching step keeps its rows' last hidden
        #: states (``last_hidden``), which an MLP speculator proposes from
        #: (``"method": "mlp_speculator"``; the served model only).
        self.keeps_hidden = (spec is not None
                             and spec.method == "mlp_speculator"
                             and vllm_config.model_config.runner_type !=
                             "draft")
        #: The last ``paged_step``'s hidden states, as its logits are
        #: shaped (``[B, hidden]``, or ``[B, last_n, hidden]``), where
        #: ``keeps_hidden``.
        self.last_hidden: Optional[torch.Tensor] = None
        #: Whether the model takes images (``spyre_image_inputs``): its
        #: prefills then run on the positions' embeddings (``embed``,
        #: ``prompt_embeds``), its decode steps on token ids.
        self.embeds_prompts = False

    def build(self) -> nn.Module:
        raise NotImplementedError

    def static_step(self, graphs, graph: str, input_ids: torch.Tensor,
                    positions: torch.Tensor, caches: list,
                    mask: torch.Tensor, cache_slots: torch.Tensor,
                    is_prompt: bool,
                    inputs_embeds: Optional[torch.Tensor] = None
                    ) -> torch.Tensor:
        """One step of a padded static batch on ``graphs`` (the compiled
        module): ``[B, vocab]`` logits of each row's last position;
        ``inputs_embeds`` (a prefill's, ``[B, L, hidden]``) only where
        ``embeds_prompts``."""
        raise NotImplementedError

    def paged_step(self, graphs, graph: str, step: PagedInputs,
                   caches: list, window: int,
                   last_n: int = 1) -> torch.Tensor:
        """One continuous-batching prefill or decode step on the block
        pool: ``[B, vocab]`` logits of each row's last position, or with
        ``last_n > 1`` (a speculative verify step) ``[B, last_n, vocab]``
        of its last ``last_n``; their hidden states in ``last_hidden``
        where ``keeps_hidden``."""
        raise NotImplementedError

    def prompt_hidden(self, ids: torch.Tensor) -> torch.Tensor:
        """The last hidden states of one whole prompt (``[1, L]``), run
        uncompiled and without a cache: ``[1, L, hidden]``."""
        raise NotImplementedError

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings of ``[B, L]`` ids: ``[B, L, hidden]``
        (a text prefill of a model that takes images)."""
        raise NotImplementedError

    def prompt_embeds(self, token_ids: torch.Tensor,
                      images: dict) -> torch.Tensor:
        """A prompt's embeddings, ``[n, hidden]``, each image's at its
        placeholders (``images``: the model's keyword arguments of the
        request's images, tensors)."""
        raise NotImplementedError

    def prompt_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of ``[1, n, hidden]`` hidden states: ``[n,
        vocab]``."""
        raise NotImplementedError

    def update_weights_in_place(self, state_dict, frozen: bool) -> int:
        raise NotImplementedError(
            f"In-place weight updates are not supported on Spyre with "
            f"{self.name}'s model code")
