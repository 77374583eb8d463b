"""Granite 4 in the forms FMS 1.13.1 lacks, as an FMS model built from
FMS's own layers.

FMS's ``granite_moe_hybrid`` is Granite 4's dense form (a Granite
subclass: every layer attention, rotary positions, no experts).  The
models IBM ships as Granite 4 ``-h`` are hybrids: most layers are
Mamba-2 layers (``layer_types``), the attention layers use no position
embedding (``position_embedding_type: nope``), and the larger ones add a
mixture of experts beside the shared MLP.  ``Granite4`` computes what
transformers' ``GraniteMoeHybridForCausalLM`` computes, with FMS's
modules: ``MultiHeadAttention`` (the attention multiplier as its scale,
rotary embeddings only when the config asks for them), FMS's Mamba-2
``SSM`` (run over Spyre's state slots by ``spyre_mamba``, as Bamba's),
``GatedLinearUnit`` for the shared MLP, and for the experts
``spyre_moe``'s dense form (every expert on every token, weighted by the
router; FMS's expert weights, split under tensor parallelism as
Mixtral's), whose shapes never depend on the routing.  Per layer::

    h = x + residual_multiplier * mixer(norm(x))           # Mamba-2 or attention
    y = h + residual_multiplier * (shared_mlp(norm(h)) + experts(norm(h)))

after an embedding scaled by ``embedding_multiplier``; the logits are
divided by ``logits_scaling``.  The model is registered with FMS as
architecture ``spyre_granite4`` with one adapter, ``hf``, which reads a
checkpoint as transformers saves it (``register``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

import torch
from torch import nn

from vllm.model_executor.layers.spyre_moe import expert_sum, router_weights
from vllm.model_executor.models import spyre_fms_decoder
from vllm.model_executor.models.spyre_fms_decoder import (DECODER_RENAMES,
                                                          CausalLM,
                                                          DecoderConfig,
                                                          DecoderStack,
                                                          renamed, rms_norm)

ARCHITECTURE = "spyre_granite4"
VARIANT = "hf"


@dataclasses.dataclass
class Granite4Config(DecoderConfig):
    """The FMS config of a Granite 4 model.  The fields FMS's own Granite
    4 mapping produces keep their meaning; the rest come from
    ``config_from_hf``."""

    activation_fn: str = "silu"
    # Granite's multipliers.
    embedding_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Positions: rotary embeddings, or none (transformers applies them
    # only for position_embedding_type "rope"; the -h models say "nope").
    rope: bool = False
    rope_theta: float = 10_000.0
    # The shared MLP: ``int(hidden_grow_factor * emb_dim)`` wide.
    hidden_grow_factor: float = 4.0
    multiple_of: int = 1
    # layer_types: "mamba" or "attention" per layer.
    mamba_n_heads: int = 128
    mamba_head_dim: int = 64
    state_size: int = 128
    conv_kernel: int = 4
    mamba_expand: float = 2.0
    n_groups: int = 1
    chunk_size: int = 256
    use_bias: bool = False
    use_conv_bias: bool = True
    # The mixture of experts (0 experts: none).
    experts: int = 0
    experts_per_token: int = 0
    expert_width: int = 0


def config_from_hf(hf_config) -> dict:
    """``Granite4Config`` fields a Hugging Face ``GraniteMoeHybridConfig``
    sets beyond FMS's mapping of it (which reads the dense form) and the
    dense form's corrections (its padding id and shared MLP width,
    ``spyre_families``)."""
    n = hf_config.num_hidden_layers
    return dict(
        variant=VARIANT,
        # transformers' attention heads are hidden / heads wide.
        head_dim=hf_config.hidden_size // hf_config.num_attention_heads,
        rope=hf_config.position_embedding_type == "rope",
        layer_types=list(getattr(hf_config, "layer_types", None)
                         or ["mamba"] * n),
        mamba_n_heads=hf_config.mamba_n_heads,
        mamba_head_dim=hf_config.mamba_d_head,
        state_size=hf_config.mamba_d_state,
        conv_kernel=hf_config.mamba_d_conv,
        mamba_expand=hf_config.mamba_expand,
        n_groups=hf_config.mamba_n_groups,
        chunk_size=hf_config.mamba_chunk_size,
        use_bias=hf_config.mamba_proj_bias,
        use_conv_bias=hf_config.mamba_conv_bias,
        experts=hf_config.num_local_experts or 0,
        experts_per_token=hf_config.num_experts_per_tok or 0,
        expert_width=hf_config.intermediate_size,
    )


class Granite4Experts(nn.Module):
    """Granite 4's mixture of experts, computed densely: the router's
    top-k of a softmax, renormalised (what transformers' softmax over the
    top-k logits gives), weights every expert's SwiGLU output, zero for
    the experts a token did not choose.  The experts' weights are FMS's
    ``ConditionalFeedForward`` parameters, whose layout is transformers'
    (``w13`` ``[E, 2I, D]``, gate then up; ``w2`` ``[E, D, I]``), so under
    tensor parallelism FMS shards them as Mixtral's (a slice of every
    expert's inner dimension per rank) and the partial sums are
    all-reduced; the router (``[E, D]``) stays whole."""

    def __init__(self, dim: int, experts: int, top_k: int, width: int):
        super().__init__()
        from fms.modules.feedforward import ConditionalFeedForward
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.cond_ffn = ConditionalFeedForward(experts, dim, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights = router_weights(self.router(flat).float(),
                                 self.top_k).to(flat.dtype)
        return expert_sum(flat, self.cond_ffn, weights).view(x.shape)


class Granite4Block(nn.Module):
    """One decoder layer: a Mamba-2 layer (``ssm``) or attention
    (``attn``), then the shared MLP and the experts, each residual branch
    scaled by ``residual_multiplier``."""

    def __init__(self, config: Granite4Config, rotary, index: int):
        super().__init__()
        from fms.modules.attention import MultiHeadAttention
        from fms.modules.feedforward import GatedLinearUnit
        from fms.modules.ssm import SSM
        from fms.utils.activation import str_to_activation
        c = config
        if c.layer_types[index] == "attention":
            self.attn = MultiHeadAttention(
                c.emb_dim, c.head_dim, c.head_dim, c.nheads, c.kvheads,
                p_dropout=c.p_dropout, use_bias=c.attn_bias,
                position_encoder=rotary,
                fused=c.fused_weights, linear_config=c.linear_config,
                scale_factor=c.attention_multiplier)
        else:
            self.ssm = SSM(c.mamba_n_heads, c.emb_dim, c.state_size,
                           c.conv_kernel, c.mamba_expand, c.use_bias,
                           c.use_conv_bias, c.activation_fn, c.norm_eps,
                           c.n_groups, c.mamba_head_dim, c.chunk_size)
        self.ff_sub_layer = GatedLinearUnit(
            c.emb_dim, hidden_grow_factor=c.hidden_grow_factor,
            multiple_of=c.multiple_of,
            activation_fn=str_to_activation(c.activation_fn),
            p_dropout=c.p_dropout, use_bias=False, fused=c.fused_weights,
            linear_config=c.linear_config)
        if c.experts:
            self.experts = Granite4Experts(c.emb_dim, c.experts,
                                           c.experts_per_token,
                                           c.expert_width)

        self.ln = rms_norm(c.emb_dim, c.norm_eps)
        self.ff_ln = rms_norm(c.emb_dim, c.norm_eps)
        self.residual_multiplier = c.residual_multiplier

    def forward(self, x, *, position_ids=None, past_key_value_state=None,
                use_cache=False, **attn_kwargs):
        h = self.ln(x)
        if hasattr(self, "ssm"):
            out = self.ssm(h, past_key_value_state=past_key_value_state,
                           use_cache=use_cache,
                           mask=attn_kwargs.get("mask"))
        else:
            out = self.attn(h, position_ids=position_ids,
                            past_key_value_state=past_key_value_state,
                            use_cache=use_cache, **attn_kwargs)
        cache = None
        if isinstance(out, tuple):
            out, cache = out
        x = x + out * self.residual_multiplier
        h = self.ff_ln(x)
        mlp = self.ff_sub_layer(h)
        if hasattr(self, "experts"):
            mlp = mlp + self.experts(h)
        x = x + mlp * self.residual_multiplier
        return (x, cache) if use_cache else x


class Granite4Headless(DecoderStack):
    """The embedding (times ``embedding_multiplier``), the layers and the
    final norm; rotary tables only with rotary positions."""

    def __init__(self, config: Granite4Config, distributed_strategy):
        from fms.modules.positions import RotaryEmbedding
        rot_emb = (RotaryEmbedding(
            dim=config.head_dim, scaling={"rope_type": "regular"},
            max_seq_len=config.max_expected_seq_len,
            ratio=config.rope_theta) if config.rope else None)
        super().__init__(
            config, distributed_strategy,
            lambda c, i: Granite4Block(c, rot_emb, i),
            embedding_scale=config.embedding_multiplier)
        self.rot_emb = rot_emb

    def post_init(self) -> None:
        """Rotary tables on the device the loaded weights are on."""
        if self.rot_emb is not None:
            self.rot_emb.compute_freqs_cis(self.embedding.weight.device,
                                           self.config.max_expected_seq_len)


class Granite4(CausalLM):
    """Granite 4 (``GraniteMoeHybridForCausalLM``) as an FMS model: the
    headless model, then the output head, the logits divided by
    ``logits_scaling``."""

    headless = Granite4Headless
    default_config = Granite4Config

    @property
    def logits_scale(self) -> float:
        return self.config.logits_scaling


# ---- transformers' checkpoint layout -------------------------------------

_RENAMES = DECODER_RENAMES + (
    (r"\.mamba\.", ".ssm."),
    (r"\.shared_mlp\.output_linear\.", ".ff_sub_layer.w2."),
    (r"\.block_sparse_moe\.router\.layer\.", ".experts.router."),
    (r"\.block_sparse_moe\.input_linear\.weight$", ".experts.cond_ffn.w13"),
    (r"\.block_sparse_moe\.output_linear\.weight$", ".experts.cond_ffn.w2"),
    (r"\.input_layernorm\.", ".ln."),
    (r"\.post_attention_layernorm\.", ".ff_ln."),
)
_SHARED_INPUT = re.compile(r"^(.*)\.shared_mlp\.input_linear\.weight$")


def _hf_to_fms_names(input_sd: Mapping[str, Any],
                     **kwargs) -> Mapping[str, Any]:
    """Adapter step: transformers' names become ``Granite4``'s; the shared
    MLP's fused input projection (gate, then up) is split into FMS's
    ``wg`` and ``w1``."""
    out: dict[str, Any] = {}
    for name, tensor in input_sd.items():
        shared = _SHARED_INPUT.match(name)
        name = renamed(name, _RENAMES)
        if shared:
            prefix = name[:-len(".shared_mlp.input_linear.weight")]
            gate, up = tensor.chunk(2, dim=0)
            out[f"{prefix}.ff_sub_layer.wg.weight"] = gate
            out[f"{prefix}.ff_sub_layer.w1.weight"] = up
            continue
        out[name] = tensor
    return out


def _hf_to_fms_rope(input_sd: Mapping[str, Any], model_config=None,
                    **kwargs) -> Mapping[str, Any]:
    """Adapter step: with rotary embeddings, the q/k projections in FMS's
    rotary layout (FMS's Granite step); without them, unchanged."""
    if model_config is None or not model_config.rope:
        return input_sd
    from fms.models.granite import _hf_to_fms_rope as granite_rope
    return granite_rope(input_sd, model_config=model_config, **kwargs)


def register() -> None:
    """Registers ``Granite4`` with FMS (architecture ``spyre_granite4``,
    variant ``hf``, adapter ``hf``), once per process."""
    spyre_fms_decoder.register(ARCHITECTURE, VARIANT, Granite4, {
        "hf_to_fms_names": _hf_to_fms_names,
        "hf_to_fms_rope": _hf_to_fms_rope})
