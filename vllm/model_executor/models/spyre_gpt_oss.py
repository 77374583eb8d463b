"""GPT-OSS (``GptOssForCausalLM``) as an FMS model built from FMS's layers,
loading checkpoints as transformers saves them.

FMS 1.13.1 has a ``gpt_oss`` model, but it loads only MXFP4 expert
weights, sizes its experts by the hidden size, gives every sliding layer a
window of 128 whatever the config says, applies its own fixed YaRN
parameters and runs its experts through ``moe_mm``, whose shapes depend on
the routing.  ``GptOss`` here computes what transformers' model computes:

* attention with biases, one learned sink logit per head (FMS's
  ``MultiHeadAttention`` with ``has_sinks``), the layers that
  ``layer_types`` marks ``sliding_attention`` over the config's
  ``sliding_window`` and the others over the whole context (each layer
  gives FMS's ``sliding_window`` argument to the Spyre attention ops);
* rotary embeddings in transformers' layout (halves, not pairs) from the
  config's own ``rope_scaling`` (YaRN in the released models), whose
  frequencies and attention factor transformers' rope functions compute
  (``Rotary``), so the q/k weights load unchanged;
* the mixture of experts computed densely (``Experts``): the router's
  top-k logits (with the router's bias) through a softmax weight every
  expert's clamped SwiGLU (``alpha`` 1.702, ``swiglu_limit``), with the
  experts' biases; the shapes never depend on the routing, so static
  batching, continuous batching's dynamic batch and the graph cache all
  compile it once.

The model is registered with FMS as architecture ``spyre_gpt_oss`` with
one adapter, ``hf`` (``register``).  Under tensor parallelism FMS splits
the attention (the sinks with their heads); the experts stay whole on
every rank.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.models import spyre_fms_decoder
from vllm.model_executor.models.spyre_fms_decoder import (DECODER_RENAMES,
                                                          CausalLM,
                                                          DecoderConfig,
                                                          DecoderStack,
                                                          renamed, rms_norm)

ARCHITECTURE = "spyre_gpt_oss"
VARIANT = "hf"
#: The gate's slope in GPT-OSS's SwiGLU (transformers' ``GptOssExperts``).
SWIGLU_ALPHA = 1.702
#: Rotary scalings whose frequencies change with the sequence's length.
_DYNAMIC_ROPE = ("dynamic", "longrope")


@dataclasses.dataclass
class GptOssConfig(DecoderConfig):
    """The FMS config of a GPT-OSS model (``config_from_hf``)."""

    # The window of the layers ``layer_types`` marks "sliding_attention"
    # (the others: "full_attention").
    window: int = 128
    # Rotary embeddings: transformers' inverse frequencies, and the factor
    # on their cosines and sines.
    inv_freq: list = dataclasses.field(default_factory=list)
    rope_scale: float = 1.0
    # The mixture of experts.
    experts: int = 32
    experts_per_token: int = 4
    expert_width: int = 2880
    swiglu_limit: float = 7.0


def config_from_hf(hf_config) -> dict:
    """``GptOssConfig`` fields of a Hugging Face ``GptOssConfig``.  A rotary
    scaling whose frequencies depend on the sequence length is refused
    (``NotImplementedError``)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = getattr(hf_config, "rope_scaling", None) or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in _DYNAMIC_ROPE or kind not in ROPE_INIT_FUNCTIONS:
        raise NotImplementedError(
            f"GptOssForCausalLM is not supported on Spyre with rope_scaling "
            f"{scaling!r}: rope_type {kind!r} is not one of "
            f"{sorted(set(ROPE_INIT_FUNCTIONS) - set(_DYNAMIC_ROPE))}")
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](hf_config, "cpu")
    n = hf_config.num_hidden_layers
    heads = hf_config.num_attention_heads
    return dict(
        variant=VARIANT,
        src_vocab_size=hf_config.vocab_size,
        emb_dim=hf_config.hidden_size,
        nheads=heads,
        kvheads=hf_config.num_key_value_heads or heads,
        head_dim=(getattr(hf_config, "head_dim", None)
                  or hf_config.hidden_size // heads),
        nlayers=n,
        norm_eps=hf_config.rms_norm_eps,
        attn_bias=bool(getattr(hf_config, "attention_bias", True)),
        max_expected_seq_len=hf_config.max_position_embeddings,
        pad_id=None,
        tie_heads=bool(hf_config.tie_word_embeddings),
        layer_types=list(getattr(hf_config, "layer_types", None)
                         or ["full_attention"] * n),
        window=int(getattr(hf_config, "sliding_window", None) or 0),
        inv_freq=inv_freq.float().tolist(),
        rope_scale=float(factor),
        experts=hf_config.num_local_experts,
        experts_per_token=hf_config.num_experts_per_tok,
        expert_width=hf_config.intermediate_size,
        swiglu_limit=_swiglu_limit(hf_config),
    )


def _swiglu_limit(hf_config) -> float:
    """The experts' clamp: the config's ``swiglu_limit`` (7 in the
    released models; transformers' model always clamps at 7)."""
    limit = getattr(hf_config, "swiglu_limit", None)
    return 7.0 if limit is None else float(limit)


class Rotary:
    """Rotary embeddings in transformers' layout (each head's first half
    rotated against its second), for FMS's attention as its
    ``position_encoder``: angles ``position * inv_freq`` in float32, their
    cosines and sines scaled by ``scale`` (YaRN's attention factor).  The
    frequencies are a constant of the compiled graphs, made on the
    query's device (FMS may build the model on the meta device)."""

    def __init__(self, inv_freq: list, scale: float):
        self.inv_freq = [float(f) for f in inv_freq]
        self.scale = scale

    def adjusted_qk(self, q: torch.Tensor, k: torch.Tensor,
                    position_ids: Optional[torch.Tensor],
                    past_key_value_state=None, use_cache: bool = False):
        """q, k: [B, L, heads, head_dim]; position_ids: [B, L]."""
        if position_ids is None:
            position_ids = torch.arange(q.shape[1],
                                        device=q.device).unsqueeze(0)
        inv_freq = torch.tensor(self.inv_freq, dtype=torch.float32,
                                device=q.device)
        angles = position_ids.unsqueeze(-1).float() * inv_freq
        cos = (angles.cos() * self.scale).to(q.dtype).unsqueeze(2)
        sin = (angles.sin() * self.scale).to(q.dtype).unsqueeze(2)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            first, second = x.chunk(2, dim=-1)
            return torch.cat((first * cos - second * sin,
                              second * cos + first * sin), dim=-1)

        return rotate(q), rotate(k)


class Experts(nn.Module):
    """GPT-OSS's mixture of experts, computed densely.  The weights keep
    transformers' layout and names: ``gate_up_proj`` ``[E, D, 2I]`` (gate
    and up interleaved, gate first), ``down_proj`` ``[E, I, D]``, each with
    a bias, and a biased ``router``.  Each token's top-k router logits go
    through a softmax; every expert runs on every token (one at a time, in
    expert order, as transformers sums them), weighted by its share, zero
    for the experts the token did not choose."""

    def __init__(self, dim: int, experts: int, top_k: int, width: int,
                 limit: float):
        super().__init__()
        self.top_k, self.limit = top_k, limit
        self.router = nn.Linear(dim, experts, bias=True)
        self.gate_up_proj = nn.Parameter(torch.empty(experts, dim, 2 * width))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * width))
        self.down_proj = nn.Parameter(torch.empty(experts, width, dim))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        top, chosen = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.zeros_like(logits).scatter(
            1, chosen, F.softmax(top, dim=1, dtype=top.dtype))
        out = torch.zeros_like(flat)
        for e in range(self.gate_up_proj.shape[0]):
            gate_up = flat @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]
            gate = gate_up[..., ::2].clamp(max=self.limit)
            up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)
            glu = gate * torch.sigmoid(gate * SWIGLU_ALPHA)
            y = ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]
            out = out + y * weights[:, e:e + 1]
        return out.view(x.shape)


class GptOssBlock(nn.Module):
    """One decoder layer: attention with sinks over its window, then the
    experts, each after an RMS norm and with a residual connection."""

    def __init__(self, config: GptOssConfig, rotary: Rotary, index: int):
        super().__init__()
        from fms.modules.attention import MultiHeadAttention
        c = config
        self.attn = MultiHeadAttention(
            c.emb_dim, c.head_dim, c.head_dim, c.nheads, c.kvheads,
            p_dropout=c.p_dropout, use_bias=c.attn_bias,
            position_encoder=rotary, fused=c.fused_weights,
            linear_config=c.linear_config, scale_factor=c.head_dim**-0.5,
            has_sinks=True)
        #: This layer's window (0: the whole context).
        self.window = (c.window if c.layer_types[index] == "sliding_attention"
                       else 0)
        self.experts = Experts(c.emb_dim, c.experts, c.experts_per_token,
                               c.expert_width, c.swiglu_limit)

        self.ln = rms_norm(c.emb_dim, c.norm_eps)
        self.ff_ln = rms_norm(c.emb_dim, c.norm_eps)

    def forward(self, x, *, position_ids=None, past_key_value_state=None,
                use_cache=False, **attn_kwargs):
        out = self.attn(self.ln(x), position_ids=position_ids,
                        past_key_value_state=past_key_value_state,
                        use_cache=use_cache, sliding_window=self.window,
                        **attn_kwargs)
        cache = None
        if use_cache:
            out, cache = out
        x = x + out
        x = x + self.experts(self.ff_ln(x))
        return (x, cache) if use_cache else x


class GptOssHeadless(DecoderStack):
    """The embedding, the layers and the final norm.  Without an op
    named (a whole prompt, no cache), FMS's attention with sinks: causal,
    each layer over its window."""

    default_attention = "sdpa_with_sinks"

    def __init__(self, config: GptOssConfig, distributed_strategy):
        rot_emb = Rotary(config.inv_freq, config.rope_scale)
        super().__init__(config, distributed_strategy,
                         lambda c, i: GptOssBlock(c, rot_emb, i))
        self.rot_emb = rot_emb


class GptOss(CausalLM):
    """GPT-OSS as an FMS model: the headless model, then the output
    head."""

    headless = GptOssHeadless
    default_config = GptOssConfig


# ---- transformers' checkpoint layout -------------------------------------

_RENAMES = DECODER_RENAMES + (
    (r"\.self_attn\.sinks$", ".attn.sinks"),
    (r"\.mlp\.router\.", ".experts.router."),
    (r"\.mlp\.experts\.", ".experts."),
    (r"\.input_layernorm\.", ".ln."),
    (r"\.post_attention_layernorm\.", ".ff_ln."),
)


def _hf_to_fms_names(input_sd: Mapping[str, Any],
                     **kwargs) -> Mapping[str, Any]:
    """Adapter step: transformers' names become ``GptOss``'s.  MXFP4
    expert weights (``*_blocks``, ``*_scales``, as OpenAI released them)
    are refused: dequantize them to bfloat16 first."""
    out: dict[str, Any] = {}
    for name, tensor in input_sd.items():
        if name.endswith(("_blocks", "_scales")):
            raise NotImplementedError(
                f"GPT-OSS checkpoint tensor {name}: MXFP4 expert weights "
                "are not supported on Spyre; use a checkpoint with "
                "bfloat16 experts (transformers' Mxfp4Config(dequantize="
                "True) writes one)")
        out[renamed(name, _RENAMES)] = tensor
    return out


def register() -> None:
    """Registers ``GptOss`` with FMS (architecture ``spyre_gpt_oss``,
    variant ``hf``, adapter ``hf``), once per process."""
    spyre_fms_decoder.register(ARCHITECTURE, VARIANT, GptOss,
                               {"hf_to_fms_names": _hf_to_fms_names})
