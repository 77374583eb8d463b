"""The FMS decoder families Spyre runs, and how each is loaded.

``FmsModelCode`` builds its model with FMS's ``get_model`` from a Hugging
Face folder.  FMS 1.13.1 maps a Hugging Face ``config.json`` to its own
model config (``fms.models.hf.config_utils``), but for some families that
mapping drops a field, so a checkpoint whose value differs from FMS's
default would load wrong or not at all:

* Mistral and Qwen3 round the MLP width up to a multiple of 256;
* Qwen3 ignores ``rope_theta`` (FMS's own default is Qwen3's usual 1e6);
* GPT-BigCode zeroes the position embedding of every token equal to its
  ``pad_id`` (0 by default), a real token of most vocabularies; Spyre's
  inputs mark padding with masks and position ids instead;
* Mixtral ignores ``num_key_value_heads`` (FMS's default is 8), and its
  ``hf`` adapter reads Mistral's original checkpoint layout only, not the
  layout ``transformers`` saves;
* null optional fields (GPT-BigCode's ``n_inner``, ...) fail or pass
  through: ``spyre_hf_config`` gives them transformers' meaning first,
  for every family.

Granite 4's forms FMS's ``granite_moe_hybrid`` (its dense form) lacks,
Mamba-2 layers, experts or no rotary embeddings, run on Spyre's own FMS
model, ``spyre_granite4``: the family's ``form`` picks it from the config.
GPT-OSS, whose FMS model reads only MXFP4 checkpoints, runs on
``spyre_gpt_oss`` (attention sinks, a window on alternate layers, biased
clamped experts).

Each ``DecoderFamily`` states those corrections as config overrides and,
for Mixtral, a checkpoint adapter (source ``spyre_hf``) and a step run on
the loaded model (its mixture-of-experts layers made dense,
``spyre_moe``), so the loader itself has no per-family branches.  A
folder of any other architecture is refused at start-up, before anything
is loaded (``spyre_model_impl.resolve``; ``family_of`` too).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

import torch

from vllm.model_executor.models import spyre_tp_dims as tp


def _no_fixes(hf_config) -> dict:
    return {}


def _mlp_width(hf_config) -> dict:
    """The MLP width is ``intermediate_size`` exactly."""
    return {"multiple_of": 1}


def _qwen3_fixes(hf_config) -> dict:
    return {**_mlp_width(hf_config), "rope_theta": hf_config.rope_theta}


def _no_pad_id(hf_config) -> dict:
    return {"pad_id": None}


def _mixtral_fixes(hf_config) -> dict:
    return {"kvheads": hf_config.num_key_value_heads}


def _bamba_fixes(hf_config) -> dict:
    """Which layers attend and the MLP width exactly (FMS's mapping leaves
    its 9.8B variant's), and the rope base from the config."""
    return {"attn_layer_indices": list(hf_config.attn_layer_indices),
            "multiple_of": 1, "rope_theta": hf_config.rope_theta}


def _granite4_fixes(hf_config) -> dict:
    """The padding id and MLP width from the config (FMS's mapping leaves
    its 8b variant's: a padding id past a small vocabulary, and the
    experts' width where the dense form has ``shared_intermediate_size``).
    The width is given exactly here (the ratio nudged as
    ``spyre_hf_config`` does), replacing the mapping's."""
    width, hidden = hf_config.shared_intermediate_size, hf_config.hidden_size
    return {"pad_id": hf_config.pad_token_id,
            "hidden_grow_factor": (width + 0.5) / hidden}


def _granite4_layer_types(hf_config) -> list[str]:
    n = hf_config.num_hidden_layers
    return list(getattr(hf_config, "layer_types", None) or ["mamba"] * n)


def _granite4_form(hf_config) -> Optional["DecoderFamily"]:
    """Granite 4's forms FMS's ``granite_moe_hybrid`` (the dense form, a
    Granite subclass) lacks run on ``spyre_granite4``'s model: Mamba-2
    layers (the ``-h`` models), experts, or no rotary embeddings (any
    ``position_embedding_type`` but ``rope``, as in transformers).  What
    that model does not compute is refused (``NotImplementedError``)."""
    types = _granite4_layer_types(hf_config)
    experts = (hf_config.num_local_experts or 0) > 0
    rope = hf_config.position_embedding_type == "rope"
    if "mamba" not in types and not experts and rope:
        return None
    why = None
    if "attention" not in types:
        why = (f"all {len(types)} layers are Mamba-2 layers (layer_types); "
               "Spyre's caches need at least one attention layer")
    elif experts and hf_config.hidden_act != "silu":
        why = (f"experts with hidden_act {hf_config.hidden_act!r} (Spyre's "
               "dense experts compute SwiGLU, silu)")
    elif rope and getattr(hf_config, "rope_scaling", None):
        why = (f"rope_scaling {hf_config.rope_scaling!r} (Spyre's Granite 4 "
               "applies plain rotary embeddings)")
    if why is not None:
        raise NotImplementedError(
            f"GraniteMoeHybridForCausalLM is not supported on Spyre with "
            f"this config: {why}.")
    return _GRANITE4_HYBRID if "mamba" in types else _GRANITE4_OTHER


def _granite4_other_fixes(hf_config) -> dict:
    """The dense form's corrections, and the fields of the forms it
    lacks."""
    from vllm.model_executor.models.spyre_granite4 import config_from_hf
    return {**_granite4_fixes(hf_config), **config_from_hf(hf_config)}


def _gpt_oss_fixes(hf_config) -> dict:
    """Every field of ``spyre_gpt_oss``'s config, from the Hugging Face
    config with its null fields read as transformers reads them (FMS's
    own mapping is for its ``gpt_oss`` model)."""
    from vllm.model_executor.models.spyre_gpt_oss import config_from_hf
    from vllm.model_executor.models.spyre_hf_config import (
        with_null_meanings)
    return config_from_hf(with_null_meanings(hf_config)[0])


def _same_form(hf_config) -> Optional["DecoderFamily"]:
    return None


def _as_loaded(model) -> None:
    return None


def _mamba_state_slots(model) -> None:
    from vllm.model_executor.layers.spyre_mamba import use_spyre_ssm
    use_spyre_ssm(model)


def _dense_experts(model) -> None:
    from vllm.model_executor.layers.spyre_moe import use_dense_experts
    use_dense_experts(model)


def window_of(hf_config) -> Optional[int]:
    """The sliding-window length of a config whose every layer slides over
    it, if it sets one (Qwen3 only with ``use_sliding_window``, and only
    on the layers its ``layer_types`` marks ``sliding_attention``: from
    ``max_window_layers`` on); None when no layer slides.  Some layers
    sliding and others not is refused (``NotImplementedError``) for the
    families whose window is the model-wide one (``has_window``): their
    FMS models give the attention no window of a layer's own."""
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    window = getattr(hf_config, "sliding_window", None)
    if not (isinstance(window, int) and window > 0):
        return None
    types = getattr(hf_config, "layer_types", None)
    if types:
        sliding = sum(t == "sliding_attention" for t in types)
        if sliding == 0:
            return None
        if sliding < len(types):
            raise NotImplementedError(
                f"A sliding window of {window} tokens on {sliding} of "
                f"{len(types)} layers (layer_types; max_window_layers="
                f"{getattr(hf_config, 'max_window_layers', None)}) is not "
                "supported on Spyre for this architecture: it applies one "
                "window to every layer")
    return window


#: Mamba-2 layers: FMS's have no sharded form.
_MAMBA_WHOLE = (".mamba.", )
#: Granite 4: its Mamba-2 layers and its router (``spyre_granite4``; its
#: experts are split, as Mixtral's).
_GRANITE4_WHOLE = _MAMBA_WHOLE + ("block_sparse_moe.router", )
#: GPT-OSS: its stacked experts and its router (``spyre_gpt_oss``).
_GPT_OSS_WHOLE = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj",
                  "mlp.router.")


@dataclass(frozen=True)
class DecoderFamily:
    """One Hugging Face architecture and the FMS model that runs it."""

    hf_architecture: str
    fms_architecture: str
    #: Overrides of FMS's config mapping: ``hf_config -> {field: value}``.
    fixes: Callable[[Any], dict] = field(default=_no_fixes)
    #: FMS checkpoint adapter (``serialization`` source) of its weights.
    source: str = "hf"
    #: A step run on the loaded (and sharded) FMS model, before compiling.
    prepare: Callable[[Any], None] = field(default=_as_loaded)
    #: Whether the config's ``sliding_window`` applies to every layer of
    #: this family alike (the model-wide window).  A family whose layers
    #: slide differently applies its windows in its own model code.
    has_window: bool = False
    #: Mamba-2 layers beside its attention layers, whose per-sequence
    #: states live in Spyre's state slots (``spyre_mamba``).
    hybrid: bool = False
    #: Attention sinks (GPT-OSS): the attention holds its scores in a few
    #: copies at once (the memory check counts them).
    attention_sinks: bool = False
    #: Parts of the names of the checkpoint tensors this family keeps whole
    #: on every rank under tensor parallelism, besides the embeddings
    #: (``WHOLE_TENSORS``; the memory check counts them on every rank).
    whole_tensors: tuple[str, ...] = ()
    #: Another family that runs this config (None: this one does).
    form: Callable[[Any], Optional["DecoderFamily"]] = field(
        default=_same_form)
    #: The dimensions tensor parallelism splits (``spyre_tp_dims``):
    #: ``hf_config -> [TPDim]``, attention heads first.
    tp_dims: Callable[[Any], list] = field(
        default=tp.fms_mlp("intermediate_size"))

    @property
    def serves_checkpoint_layout(self) -> bool:
        """Whether the served model keeps the layout its checkpoint loads
        into (no ``prepare`` step), so new weights can be loaded in place."""
        return self.prepare in (_as_loaded, _mamba_state_slots)

    def sliding_window(self, hf_config) -> Optional[int]:
        return window_of(hf_config) if self.has_window else None


#: Every supported architecture, by its Hugging Face name.
FAMILIES: dict[str, DecoderFamily] = {
    f.hf_architecture: f
    for f in (
        DecoderFamily("LlamaForCausalLM", "llama"),
        DecoderFamily("GraniteForCausalLM", "granite"),
        DecoderFamily("GPTBigCodeForCausalLM", "gpt_bigcode", _no_pad_id,
                      tp_dims=tp.gpt_bigcode),
        DecoderFamily("MistralForCausalLM", "mistral", _mlp_width,
                      has_window=True),
        DecoderFamily("MixtralForCausalLM", "mixtral", _mixtral_fixes,
                      source="spyre_hf", prepare=_dense_experts,
                      has_window=True, tp_dims=tp.mixtral),
        DecoderFamily("Qwen3ForCausalLM", "qwen3", _qwen3_fixes,
                      has_window=True),
        DecoderFamily("BambaForCausalLM", "bamba", _bamba_fixes,
                      prepare=_mamba_state_slots, hybrid=True,
                      whole_tensors=_MAMBA_WHOLE),
        DecoderFamily("GraniteMoeHybridForCausalLM", "granite_moe_hybrid",
                      _granite4_fixes, form=_granite4_form,
                      whole_tensors=_GRANITE4_WHOLE, tp_dims=tp.granite4),
        DecoderFamily("GptOssForCausalLM", "spyre_gpt_oss", _gpt_oss_fixes,
                      attention_sinks=True, whole_tensors=_GPT_OSS_WHOLE,
                      tp_dims=tp.attention),
    )
}

#: The embeddings' names, which every family keeps whole on every rank.
EMBEDDING_NAMES = ("embed", "wte", "wpe", "tok_embeddings")
#: The tensors kept whole on every rank under tensor parallelism, in any
#: family: the embeddings and each family's ``whole_tensors``.
WHOLE_TENSORS = tuple(dict.fromkeys(
    EMBEDDING_NAMES + tuple(n for f in FAMILIES.values()
                            for n in f.whole_tensors)))

#: Granite 4 with experts or without rotary embeddings, and (hybrid) with
#: Mamba-2 layers: ``spyre_granite4``'s model, built from FMS's layers.
_GRANITE4_OTHER = DecoderFamily(
    "GraniteMoeHybridForCausalLM", "spyre_granite4", _granite4_other_fixes,
    whole_tensors=_GRANITE4_WHOLE, tp_dims=tp.granite4)
_GRANITE4_HYBRID = dataclasses.replace(
    _GRANITE4_OTHER, prepare=_mamba_state_slots, hybrid=True)


def family_of(hf_config) -> DecoderFamily:
    """The family of a Hugging Face config; a ``ValueError`` naming the
    architecture and the supported ones for any other."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in FAMILIES:
            family = FAMILIES[arch]
            return family.form(hf_config) or family
    named = ", ".join(archs) or f"model_type {hf_config.model_type!r}"
    raise ValueError(
        f"Architecture {named} is not supported on Spyre. Supported "
        f"architectures: {', '.join(FAMILIES)}.")


def fms_model_args(model_path: str, hf_config) -> dict:
    """``get_model`` arguments that load ``model_path``: FMS's own mapping
    of its ``config.json`` (null fields read as transformers reads them,
    ``spyre_hf_config``), with the family's corrections applied."""
    from vllm.model_executor.models.spyre_hf_config import fms_config_params
    family = family_of(hf_config)
    _register_adapters()
    params = fms_config_params(model_path)
    params.pop("model_path", None)
    params.update(family.fixes(hf_config))
    params.update(architecture=family.fms_architecture,
                  variant=params.pop("variant"),
                  source=family.source,
                  model_path=model_path)
    return params


# ---- Mixtral checkpoints as transformers saves them ------------------------

_MIXTRAL_RENAMES = (
    (r"^model\.embed_tokens\.", "tok_embeddings."),
    (r"^model\.norm\.", "norm."),
    (r"^lm_head\.", "output."),
    (r"^model\.layers\.", "layers."),
    (r"\.self_attn\.([qkvo])_proj\.", r".attention.w\1."),
    (r"\.input_layernorm\.", ".attention_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
)
_EXPERT = re.compile(
    r"^(layers\.\d+\.block_sparse_moe)\.experts\.(\d+)\.(w[123])\.weight$")


def _unpermute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers stores q/k projections with each head's rotary pairs
    split into halves; Mistral's original layout interleaves them."""
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2,
                       cols).transpose(1, 2).reshape(rows, cols)


def _mixtral_transformers_to_original(input_sd: Mapping[str, Any],
                                      model_config=None,
                                      **kwargs) -> Mapping[str, Any]:
    """Adapter step: a Mixtral state dict in ``transformers`` naming
    becomes the original layout that FMS's own steps read (experts of a
    layer stacked, ``w2`` stored transposed, rotary halves interleaved).
    A state dict in the original layout passes through unchanged."""
    if not any(k.startswith("model.") for k in input_sd):
        return input_sd
    out: dict[str, Any] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in input_sd.items():
        for pattern, repl in _MIXTRAL_RENAMES:
            name = re.sub(pattern, repl, name)
        match = _EXPERT.match(name)
        if match:
            prefix, index, which = match.groups()
            experts.setdefault((prefix, which), {})[int(index)] = tensor
            continue
        if name.endswith(".attention.wq.weight"):
            tensor = _unpermute_rope(tensor, model_config.nheads)
        elif name.endswith(".attention.wk.weight"):
            tensor = _unpermute_rope(tensor, model_config.kvheads)
        out[name] = tensor
    for (prefix, which), by_index in experts.items():
        stacked = [by_index[i] for i in sorted(by_index)]
        if which == "w2":
            stacked = [w.t() for w in stacked]  # [dim, inner] -> [inner, dim]
        out[f"{prefix}.{which}"] = torch.cat(stacked, dim=0)
    return out


def _register_adapters() -> None:
    """Registers with FMS, once per process, Spyre's Granite 4 and GPT-OSS
    models (``spyre_granite4``, ``spyre_gpt_oss``) and the ``spyre_hf``
    Mixtral adapter: the step above, then FMS's own steps for Mistral's
    original layout."""
    from fms.utils import serialization

    from vllm.model_executor.models import spyre_gpt_oss, spyre_granite4
    spyre_granite4.register()
    spyre_gpt_oss.register()
    if "spyre_hf" in serialization.list_sources("mixtral"):
        return
    serialization.register_adapter_step(
        "mixtral", "spyre_transformers_to_original",
        _mixtral_transformers_to_original)
    serialization.register_adapter(
        "mixtral", "spyre_hf",
        ["spyre_transformers_to_original", "hf_to_fms_names",
         "weight_fusion"])
