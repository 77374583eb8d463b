"""What Spyre's own FMS decoders share: the models FMS 1.13.1 lacks or
cannot load, built from FMS's layers (``spyre_granite4``: Granite 4's
hybrid, expert and position-free forms; ``spyre_gpt_oss``: GPT-OSS).

Each is an FMS model in FMS's shape, so the loader, the runners, the
graph cache and the compile path treat it as any FMS model: a headless
``DecoderStack`` (the embedding, the family's blocks, the final RMS norm)
under a ``CausalLM`` (the output head, tied or not, and FMS's
``forward`` signature), registered with FMS under its own architecture
name with an ``hf`` adapter that renames transformers' weights
(``register``).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Iterable, Mapping, Optional

from fms.utils.config import ModelConfig
from torch import nn


@dataclasses.dataclass
class DecoderConfig(ModelConfig):
    """The fields every Spyre-built decoder's FMS config has, named as
    FMS's own configs name them (``head_dim``: the attention heads'
    size); each family's config adds its own and ``config_from_hf`` (or
    FMS's mapping) sets them from the checkpoint's."""

    src_vocab_size: int = 32000
    emb_dim: int = 4096
    nheads: int = 32
    kvheads: int = 8
    head_dim: int = 128
    attn_bias: bool = False
    nlayers: int = 32
    norm_eps: float = 1e-5
    max_expected_seq_len: int = 131072
    pad_id: Optional[int] = None
    p_dropout: float = 0.0
    tie_heads: bool = False
    linear_config: Optional[Mapping[str, Any]] = None
    fused_weights: bool = False
    # Each layer's kind, in the family's own names.
    layer_types: list = dataclasses.field(default_factory=list)


def rms_norm(dim: int, eps: float) -> nn.Module:
    """FMS's RMS norm (a scale, no shift), in float32 inside as
    transformers'."""
    from fms.modules.layernorm import LayerNormParameterized
    return LayerNormParameterized(dim, elementwise_scale=True,
                                  elementwise_shift=False, use_mean=False,
                                  eps=eps, use_high_precision_pow=True)


class DecoderStack(nn.Module):
    """The headless model: the token embedding (times
    ``embedding_scale``), one block per layer made by ``block(config,
    index)`` and placed by FMS's distributed strategy, the final norm.
    A block takes FMS's decoder-block arguments and returns ``(x,
    cache)`` with ``use_cache``, else ``x``."""

    #: FMS's attention op for a forward that names none (a whole prompt
    #: without a cache); None: FMS's default.
    default_attention: Optional[str] = None

    def __init__(self, config, distributed_strategy,
                 block: Callable[[Any, int], nn.Module],
                 embedding_scale: float = 1.0):
        super().__init__()
        self.config = config
        self.embedding_scale = embedding_scale
        self.embedding = nn.Embedding(config.src_vocab_size, config.emb_dim)
        self.layers = nn.ModuleList([
            distributed_strategy.distribute_layer(block(config, i), i)
            for i in range(config.nlayers)])
        self.dec_norm = distributed_strategy.distribute_module(
            rms_norm(config.emb_dim, config.norm_eps), final_layers=True)

    def post_init(self) -> None:
        """Runs once the weights are loaded (FMS's ``post_init``)."""

    def forward(self, x_in, position_ids=None, past_key_value_states=None,
                use_cache=False, **attn_kwargs):
        if self.default_attention is not None:
            attn_kwargs.setdefault("attn_name", self.default_attention)
        x = self.embedding(x_in)
        if self.embedding_scale != 1.0:
            x = x * self.embedding_scale
        caches = past_key_value_states or [None] * len(self.layers)
        present = []
        for layer, cache in zip(self.layers, caches):
            out = layer(x, position_ids=position_ids,
                        past_key_value_state=cache, use_cache=use_cache,
                        **attn_kwargs)
            if use_cache:
                x, cache = out
                present.append(cache)
            else:
                x = out
        return self.dec_norm(x), present


class CausalLM(nn.Module):
    """The headless model (``headless(config, distributed_strategy)``),
    then the output head, its logits divided by ``logits_scale``; the
    head is the token embedding with ``config.tie_heads``."""

    #: ``(config, distributed_strategy) -> DecoderStack``.
    headless: Callable[..., DecoderStack]
    #: The config a model made without one gets.
    default_config: Callable[[], Any]

    def __init__(self, config=None, distributed_strategy=None, **kwargs):
        super().__init__()
        from fms.distributed.strategy import NoOpStrategy
        self.config = (config or self.default_config()).updated(**kwargs)
        self.distributed_strategy = distributed_strategy or NoOpStrategy
        self.base_model = type(self).headless(self.config,
                                              self.distributed_strategy)
        self.head = nn.Linear(self.config.emb_dim,
                              self.config.src_vocab_size, bias=False)

    @property
    def logits_scale(self) -> float:
        return 1.0

    @classmethod
    def from_config(cls, config) -> "CausalLM":
        return cls(config)

    def get_config(self):
        return self.config

    def reset_parameters(self) -> None:
        for p in self.parameters():
            nn.init.normal_(p, std=0.02)

    def post_init(self) -> None:
        if self.config.tie_heads:
            if self.head.weight.is_meta:
                self.head.weight = self.base_model.embedding.weight
            else:
                self.base_model.embedding.weight = self.head.weight
        self.base_model.post_init()

    def forward(self, x, position_ids=None, past_key_value_states=None,
                use_cache=False, last_n_tokens: int = 0, **attn_kwargs):
        from fms.modules.attention import get_attention_type
        from fms.utils.headless import gather_outputs
        default = self.base_model.default_attention
        if default is not None:
            attn_kwargs.setdefault("attn_name", default)
        get_attention_type(**attn_kwargs)["validate_attn_kwargs"](
            input_ids=x, position_ids=position_ids,
            past_key_value_states=past_key_value_states, **attn_kwargs)
        hidden, cache = self.base_model(x, position_ids,
                                        past_key_value_states, use_cache,
                                        **attn_kwargs)
        hidden = gather_outputs(hidden, last_n_tokens, **attn_kwargs)
        logits = self.head(hidden)
        if self.logits_scale != 1.0:
            logits = logits / self.logits_scale
        return (logits, cache) if use_cache else logits


#: transformers' names of the parts every decoder has, and theirs here;
#: a family's adapter adds its own.
DECODER_RENAMES = (
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.embed_tokens\.", "base_model.embedding."),
    (r"^model\.norm\.", "base_model.dec_norm."),
    (r"^model\.layers\.", "base_model.layers."),
    (r"\.self_attn\.q_proj\.", ".attn.in_proj.query."),
    (r"\.self_attn\.k_proj\.", ".attn.in_proj.key."),
    (r"\.self_attn\.v_proj\.", ".attn.in_proj.value."),
    (r"\.self_attn\.o_proj\.", ".attn.dense."),
)


def renamed(name: str, renames: Iterable[tuple[str, str]]) -> str:
    """``name`` after every ``(pattern, replacement)`` of ``renames``."""
    for pattern, repl in renames:
        name = re.sub(pattern, repl, name)
    return name


def register(architecture: str, variant: str, model: type[CausalLM],
             steps: Mapping[str, Callable[..., Mapping[str, Any]]]) -> None:
    """Registers ``model`` with FMS as ``architecture`` / ``variant``, and
    its ``hf`` adapter: ``steps`` (name -> adapter step) in order; once
    per process."""
    from fms import models
    from fms.utils import serialization
    if architecture in models.list_models():
        return

    def factory(**kwargs):
        return model(model.default_config(), **kwargs)

    models.register_model(architecture, variant, factory)
    for name, step in steps.items():
        serialization.register_adapter_step(architecture, name, step)
    serialization.register_adapter(architecture, "hf", list(steps))
