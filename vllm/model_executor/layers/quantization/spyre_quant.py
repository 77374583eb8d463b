"""Quantized checkpoints on Spyre's CPU backends: GPTQ and compressed-tensors.

A checkpoint whose ``config.json`` has a ``quantization_config`` loads by
it, as with vLLM elsewhere; ``--quantization`` may name its method
(``gptq``, ``compressed-tensors``), and a different name is vLLM's own
mismatch error.  The formats:

* **GPTQ** (``quant_method: gptq``): 4 or 8 bits, symmetric or not, group
  size 128 (or any other; a last group may be shorter) or -1 (one scale
  per output channel), ``desc_act: false``; checkpoint format ``gptq``
  (zero points stored minus one) or ``gptq_v2``; ``lm_head: true``
  quantizes the output head too.
* **compressed-tensors** (``quant_method: compressed-tensors``), as
  llm-compressor and fms-model-optimizer write it:
  ``float-quantized`` FP8 (``float8_e4m3fn`` weights with a per-tensor or
  per-channel ``weight_scale``; inputs quantized with a static per-tensor
  ``input_scale``, dynamically per token, or not at all) and
  ``pack-quantized`` int8 or int4 weight-only (symmetric, per channel or
  per group).

``SpyreQuantConfig`` is registered as vLLM quantization method ``spyre``
(``install``, a ``vllm.general_plugins`` entry point): its
``override_quantization_method`` claims those checkpoints, so vLLM's model
code is built with ``SpyreQuantLinearMethod`` in every quantized linear
layer.  That method creates the checkpoint's tensors with vLLM's parameter
classes, so the layers' own weight loaders shard codes and scales under
tensor parallelism and fill the fused q/k/v and gate/up layers shard by
shard.  After loading it turns them into one ``QuantWeight`` per layer
(codes ``[N, K]``, scales and zero points per group and output), and
``finish`` puts it on the quantized kernel (``spyre_quant_linear``) or,
off the kernels, dequantizes it once.  Anything else (another bit width,
``desc_act``, int8 activations, a quantized KV cache, ...) is refused when
the config is read, with the value and what is supported.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers import linear as vllm_linear
from vllm.model_executor.layers.linear import (LinearBase, LinearMethodBase,
                                               UnquantizedLinearMethod)
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig, QuantizeMethodBase)
from vllm.model_executor.layers.spyre_quant_linear import (QuantWeight,
                                                           fake_quantize_fp8,
                                                           pack)
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead)
from vllm.model_executor.parameter import (BasevLLMParameter,
                                           ChannelQuantScaleParameter,
                                           GroupQuantScaleParameter,
                                           ModelWeightParameter,
                                           PackedColumnParameter,
                                           PackedvLLMParameter,
                                           PerTensorScaleParameter,
                                           RowvLLMParameter)

logger = init_logger(__name__)

#: The vLLM quantization method name.
NAME = "spyre"
#: The checkpoint methods it reads.
METHODS = ("gptq", "compressed-tensors")

SUPPORTED = (
    "GPTQ (4 or 8 bits, any group size or -1, desc_act false) and compressed-tensors (float-quantized FP8 weights, "
    "per tensor or per channel, with static per-tensor, dynamic per-token "
    "or no input quantization; pack-quantized int8 or int4 symmetric "
    "weight-only, per channel or per group)")


class UnsupportedQuantization(ValueError):
    """A quantization config Spyre does not run."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{what} is not supported on Spyre. Supported "
                         f"quantization: {SUPPORTED}.")


@dataclass(frozen=True)
class Scheme:
    """How one layer's weight (and input) is quantized."""

    #: "gptq", "fp8" (float8_e4m3fn codes) or "int" (pack-quantized).
    format: str
    bits: int
    #: Input features per scale; -1: one group over all of them.
    group_size: int
    symmetric: bool = True
    #: "tensor", "channel" or "group".
    strategy: str = "group"
    #: FP8 inputs: None (weight-only), "static" or "dynamic".
    activations: Optional[str] = None
    #: GPTQ zero points stored minus one (checkpoint format "gptq").
    zeros_minus_one: bool = True

    def describe(self) -> str:
        if self.format == "fp8":
            inputs = {None: "weight-only", "static": "static input scales",
                      "dynamic": "dynamic per-token inputs"}[self.activations]
            return f"FP8 ({self.strategy} weight scales, {inputs})"
        groups = ("per channel" if self.group_size == -1 else
                  f"group {self.group_size}")
        kind = "GPTQ" if self.format == "gptq" else "int"
        return (f"{kind} {self.bits}-bit {groups}, "
                f"{'symmetric' if self.symmetric else 'asymmetric'}")


# ---- reading the checkpoint's quantization_config ---------------------------
def gptq_scheme(cfg: dict[str, Any]) -> Scheme:
    bits = cfg.get("bits")
    if bits not in (4, 8):
        raise UnsupportedQuantization(f"GPTQ with bits={bits}")
    group = cfg.get("group_size", -1)
    if not isinstance(group, int) or not (group == -1 or group > 0):
        raise UnsupportedQuantization(f"GPTQ with group_size={group}")
    if cfg.get("desc_act"):
        raise UnsupportedQuantization(
            "GPTQ with desc_act=true (activation order)")
    if cfg.get("dynamic"):
        raise UnsupportedQuantization(
            "GPTQ with per-module settings ('dynamic')")
    fmt = cfg.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise UnsupportedQuantization(f"GPTQ checkpoint_format={fmt!r}")
    return Scheme("gptq", bits, group, symmetric=bool(cfg.get("sym", True)),
                  strategy="channel" if group == -1 else "group",
                  zeros_minus_one=fmt == "gptq")


def _ct_scheme(name: str, group: dict[str, Any], fmt: str) -> Scheme:
    """One compressed-tensors config group's scheme."""
    weights = group.get("weights") or {}
    inputs = group.get("input_activations")
    if group.get("output_activations"):
        raise UnsupportedQuantization(
            f"compressed-tensors output activation quantization ({name})")
    wtype, bits = weights.get("type"), weights.get("num_bits")
    strategy = weights.get("strategy")
    if not weights.get("symmetric", True):
        raise UnsupportedQuantization(
            f"compressed-tensors asymmetric weights ({name})")
    if weights.get("actorder"):
        raise UnsupportedQuantization(
            f"compressed-tensors actorder={weights['actorder']!r} ({name})")
    if wtype == "float" and bits == 8:
        if strategy not in ("tensor", "channel"):
            raise UnsupportedQuantization(
                f"compressed-tensors FP8 weights with strategy {strategy!r} "
                f"({name})")
        activations = None
        if inputs:
            if inputs.get("type") != "float" or inputs.get("num_bits") != 8:
                raise UnsupportedQuantization(
                    f"compressed-tensors FP8 weights with "
                    f"{inputs.get('type')} {inputs.get('num_bits')}-bit "
                    f"inputs ({name})")
            if inputs.get("dynamic"):
                if inputs.get("strategy") != "token":
                    raise UnsupportedQuantization(
                        "compressed-tensors dynamic input quantization "
                        f"with strategy {inputs.get('strategy')!r} ({name})")
                activations = "dynamic"
            elif inputs.get("strategy") == "tensor":
                activations = "static"
            else:
                raise UnsupportedQuantization(
                    "compressed-tensors static input quantization with "
                    f"strategy {inputs.get('strategy')!r} ({name})")
        return Scheme("fp8", 8, -1, strategy=strategy,
                      activations=activations)
    if wtype == "int" and bits in (4, 8):
        if inputs:
            raise UnsupportedQuantization(
                f"compressed-tensors int{bits} weights with quantized "
                f"inputs ({name})")
        if fmt != "pack-quantized":
            raise UnsupportedQuantization(
                f"compressed-tensors int{bits} weights in format {fmt!r}")
        if strategy == "channel":
            group_size = -1
        elif strategy == "group":
            group_size = weights.get("group_size")
        else:
            raise UnsupportedQuantization(
                f"compressed-tensors int weights with strategy "
                f"{strategy!r} ({name})")
        return Scheme("int", bits, group_size, strategy=strategy)
    raise UnsupportedQuantization(
        f"compressed-tensors {wtype} {bits}-bit weights ({name})")


def compressed_tensors_schemes(
        cfg: dict[str, Any]) -> tuple[dict[str, Scheme], list[str]]:
    """{target: scheme} and the ignore list of a compressed-tensors
    config."""
    fmt = cfg.get("format")
    if fmt not in ("float-quantized", "pack-quantized", "naive-quantized"):
        raise UnsupportedQuantization(f"compressed-tensors format {fmt!r}")
    if cfg.get("kv_cache_scheme"):
        raise UnsupportedQuantization(
            "a quantized key/value cache (compressed-tensors "
            "kv_cache_scheme)")
    targets: dict[str, Scheme] = {}
    for name, group in (cfg.get("config_groups") or {}).items():
        scheme = _ct_scheme(name, group, group.get("format") or fmt)
        for target in group.get("targets") or []:
            targets[target] = scheme
    if not targets:
        raise UnsupportedQuantization(
            "a compressed-tensors config without config_groups")
    return targets, list(cfg.get("ignore") or [])


# ---- the vLLM quantization method -------------------------------------------
class SpyreQuantConfig(QuantizationConfig):
    """vLLM quantization method ``spyre``: GPTQ and compressed-tensors
    checkpoints on the Spyre CPU backends."""

    def __init__(self, method: str, config: dict[str, Any]) -> None:
        super().__init__()
        self.method = method
        self.config = config
        self.gptq: Optional[Scheme] = None
        self.targets: dict[str, Scheme] = {}
        self.ignore: list[str] = []
        if method == "gptq":
            self.gptq = gptq_scheme(config)
            self.head_quantized = bool(config.get("lm_head", False))
        elif method == "compressed-tensors":
            self.targets, self.ignore = compressed_tensors_schemes(config)
            from vllm.model_executor.layers.quantization \
                .compressed_tensors.utils import should_ignore_layer
            self.head_quantized = not should_ignore_layer(
                "lm_head", ignore=self.ignore) and any(
                    t in ("Linear", "lm_head") for t in self.targets)
        else:
            raise UnsupportedQuantization(f"quant_method {method!r}")

    def __repr__(self) -> str:
        return f"SpyreQuantConfig({self.method}: {self.describe()})"

    def describe(self) -> str:
        schemes = [self.gptq] if self.gptq else list(self.targets.values())
        return "; ".join(sorted({s.describe() for s in schemes}))

    def get_name(self) -> str:
        return NAME

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # The served dtype (spyre_dtypes) is float32 or bfloat16; float16,
        # what GPTQ checkpoints declare, is served in float32.
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "SpyreQuantConfig":
        method = str(config.get("quant_method", "")).lower().replace(
            "compressed_tensors", "compressed-tensors")
        return cls(method, config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg,
                                     user_quant) -> Optional[str]:
        """Claims GPTQ and compressed-tensors checkpoints on Spyre, unless
        ``--quantization`` names another method (vLLM then reports the
        mismatch)."""
        from vllm.platforms import current_platform
        from vllm.platforms.spyre_config import PLATFORM_QUALNAME
        platform = type(current_platform)
        if f"{platform.__module__}.{platform.__qualname__}" != \
                PLATFORM_QUALNAME:
            return None
        method = str(hf_quant_cfg.get("quant_method", "")).lower()
        if method in METHODS and user_quant in (None, NAME, method):
            return NAME
        return None

    def scheme_for(self, layer: nn.Module, prefix: str) -> Optional[Scheme]:
        """The scheme of the layer named ``prefix``; None: unquantized."""
        if isinstance(layer, ParallelLMHead):
            if not self.head_quantized or _tied_embeddings():
                # A tied head is the (float) token embedding: vLLM loads no
                # lm_head tensors for it.
                return None
            if self.gptq:
                return self.gptq
            return self.targets.get("lm_head") or self.targets.get("Linear")
        if self.gptq:
            return self.gptq
        from vllm.model_executor.layers.quantization.compressed_tensors \
            .utils import find_matched_target, should_ignore_layer
        mapping = self.packed_modules_mapping
        if should_ignore_layer(prefix, ignore=self.ignore,
                               fused_mapping=mapping):
            return None
        try:
            target = find_matched_target(prefix, layer, self.targets,
                                         fused_mapping=mapping)
        except ValueError:
            return None
        return self.targets[target]

    def get_quant_method(self, layer: nn.Module,
                         prefix: str) -> Optional[QuantizeMethodBase]:
        if not isinstance(layer, (LinearBase, ParallelLMHead)):
            return None
        scheme = self.scheme_for(layer, prefix)
        if scheme is None:
            return (None if isinstance(layer, ParallelLMHead) else
                    UnquantizedLinearMethod())
        return SpyreQuantLinearMethod(self, scheme)


def _tied_embeddings() -> bool:
    """Whether the model being built ties its output head to its token
    embedding."""
    from vllm.config import get_current_vllm_config
    model_config = get_current_vllm_config().model_config
    return model_config is not None and bool(
        getattr(model_config.hf_text_config, "tie_word_embeddings", False))


# ---- the layers --------------------------------------------------------------
def _unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Codes packed ``32 / bits`` to an int32 along ``dim``, the first in
    the lowest bits, as unsigned integers (int32)."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    x = packed.unsqueeze(dim + 1)
    shape = [1] * x.dim()
    shape[dim + 1] = per
    codes = (x >> shifts.view(shape)) & ((1 << bits) - 1)
    sizes = list(packed.shape)
    sizes[dim] *= per
    return codes.reshape(sizes)


def _free(layer: nn.Module, *names: str) -> None:
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)


class SpyreQuantLinearMethod(LinearMethodBase):
    """One quantized linear layer (or output head) of vLLM's model code."""

    def __init__(self, config: SpyreQuantConfig, scheme: Scheme) -> None:
        self.config = config
        self.scheme = scheme

    # -- creating the checkpoint's tensors ---------------------------------
    def create_weights(self, layer: nn.Module, input_size_per_partition: int,
                       output_partition_sizes: list[int], input_size: int,
                       output_size: int, params_dtype: torch.dtype,
                       **extra_weight_attrs) -> None:
        scheme = self.scheme
        loader = extra_weight_attrs.get("weight_loader")
        group = scheme.group_size
        if group > 0 and input_size_per_partition % group and \
                input_size_per_partition != input_size:
            raise ValueError(
                f"{scheme.describe()}: this rank's {input_size_per_partition}"
                f" input features (of {input_size}) are not a whole number of"
                f" groups of {group}; use a tensor-parallel size that splits"
                " the layer on group boundaries")
        layer.logical_widths = list(output_partition_sizes)
        layer.spyre_input_size = input_size_per_partition
        if scheme.format == "gptq":
            self._create_gptq(layer, input_size_per_partition,
                              output_partition_sizes, input_size,
                              output_size, params_dtype, extra_weight_attrs)
        elif scheme.format == "fp8":
            self._create_fp8(layer, input_size_per_partition,
                             output_partition_sizes, loader)
        else:
            self._create_packed_int(layer, input_size_per_partition,
                                    output_partition_sizes, input_size,
                                    loader)

    def _groups(self, input_size_per_partition: int) -> int:
        group = self.scheme.group_size
        return 1 if group == -1 else -(-input_size_per_partition // group)

    def _create_gptq(self, layer, input_size_per_partition,
                     output_partition_sizes, input_size, output_size,
                     params_dtype, extra) -> None:
        # GPTQ's tensors as vLLM's GPTQ layers declare them, except that a
        # last group may be shorter (SmolLM2's 576 features in groups of
        # 128: 5 groups, as GPTQ's tools write them).
        loader = extra.get("weight_loader")
        per = 32 // self.scheme.bits
        rows = sum(output_partition_sizes)
        if isinstance(layer, ParallelLMHead) and \
                layer.org_vocab_size != layer.num_embeddings_padded:
            # Its tensors hold the vocabulary on their second dimension,
            # which vLLM's head loader pads on the first only.
            raise NotImplementedError(
                f"a GPTQ-quantized output head over {layer.org_vocab_size} "
                f"tokens (padded to {layer.num_embeddings_padded}) is not "
                "supported on Spyre; quantize the head with a vocabulary "
                "that is a multiple of 64 times the tensor-parallel size, "
                "or leave it float (lm_head: false)")
        if input_size_per_partition % per or rows % per:
            raise ValueError(
                f"GPTQ {self.scheme.bits}-bit: {input_size_per_partition} "
                f"input and {rows} output features do not pack {per} to an "
                "int32; use a tensor-parallel size that keeps them whole")
        groups = self._groups(input_size_per_partition)
        split = (input_size != input_size_per_partition
                 and self.scheme.group_size != -1)
        layer.register_parameter(
            "qweight",
            PackedvLLMParameter(data=torch.empty(
                input_size_per_partition // per, rows, dtype=torch.int32),
                                input_dim=0, output_dim=1, packed_dim=0,
                                packed_factor=per, weight_loader=loader))
        layer.register_parameter(
            "g_idx",
            RowvLLMParameter(data=torch.empty(input_size_per_partition,
                                              dtype=torch.int32),
                             input_dim=0, weight_loader=loader))
        zeros = torch.empty(groups, rows // per, dtype=torch.int32)
        scales = torch.empty(groups, rows, dtype=params_dtype)
        if split:
            layer.register_parameter(
                "qzeros",
                PackedvLLMParameter(data=zeros, input_dim=0, output_dim=1,
                                    packed_dim=1, packed_factor=per,
                                    weight_loader=loader))
            layer.register_parameter(
                "scales",
                GroupQuantScaleParameter(data=scales, input_dim=0,
                                         output_dim=1, weight_loader=loader))
        else:
            layer.register_parameter(
                "qzeros",
                PackedColumnParameter(data=zeros, output_dim=1, packed_dim=1,
                                      packed_factor=per,
                                      weight_loader=loader))
            layer.register_parameter(
                "scales",
                ChannelQuantScaleParameter(data=scales, output_dim=1,
                                           weight_loader=loader))

    def _create_fp8(self, layer, input_size_per_partition,
                    output_partition_sizes, loader) -> None:
        rows = sum(output_partition_sizes)
        layer.register_parameter(
            "weight",
            ModelWeightParameter(data=torch.empty(rows,
                                                  input_size_per_partition,
                                                  dtype=torch.float8_e4m3fn),
                                 input_dim=1, output_dim=0,
                                 weight_loader=loader))
        if self.scheme.strategy == "channel":
            scale = ChannelQuantScaleParameter(
                data=torch.empty(rows, 1, dtype=torch.float32),
                output_dim=0, weight_loader=loader)
        else:
            scale = PerTensorScaleParameter(
                data=torch.empty(len(output_partition_sizes),
                                 dtype=torch.float32),
                weight_loader=loader)
        layer.register_parameter("weight_scale", scale)
        if self.scheme.activations == "static":
            layer.register_parameter(
                "input_scale",
                PerTensorScaleParameter(
                    data=torch.empty(len(output_partition_sizes),
                                     dtype=torch.float32),
                    weight_loader=loader))

    def _create_packed_int(self, layer, input_size_per_partition,
                           output_partition_sizes, input_size,
                           loader) -> None:
        per = 32 // self.scheme.bits
        if input_size_per_partition % per:
            raise ValueError(f"{input_size_per_partition} input features do"
                             f" not pack {per} to an int32")
        rows = sum(output_partition_sizes)
        layer.register_parameter(
            "weight_packed",
            PackedvLLMParameter(data=torch.empty(
                rows, input_size_per_partition // per, dtype=torch.int32),
                                input_dim=1, output_dim=0, packed_dim=1,
                                packed_factor=per, weight_loader=loader))
        if self.scheme.group_size == -1:
            scale = ChannelQuantScaleParameter(
                data=torch.empty(rows, 1, dtype=torch.float32),
                output_dim=0, weight_loader=loader)
        else:
            groups = self._groups(input_size_per_partition)
            row_parallel = input_size != input_size_per_partition
            scale = (GroupQuantScaleParameter if row_parallel else
                     ChannelQuantScaleParameter)(
                         data=torch.empty(rows, groups, dtype=torch.float32),
                         output_dim=0, weight_loader=loader,
                         **({"input_dim": 1} if row_parallel else {}))
        layer.register_parameter("weight_scale", scale)
        layer.register_parameter(
            "weight_shape",
            BasevLLMParameter(data=torch.empty(2, dtype=torch.int64),
                              weight_loader=loader))

    # -- after loading -------------------------------------------------------
    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The loaded tensors become one ``QuantWeight`` (``spyre_quant``),
        put on the kernel by ``finish``."""
        fmt = self.scheme.format
        with torch.no_grad():
            if fmt == "gptq":
                weight = self._gptq_weight(layer)
                _free(layer, "qweight", "qzeros", "scales", "g_idx")
            elif fmt == "fp8":
                weight = self._fp8_weight(layer)
                _free(layer, "weight", "weight_scale")
            else:
                weight = self._int_weight(layer)
                _free(layer, "weight_packed", "weight_scale", "weight_shape")
        layer.spyre_quant = weight

    def _gptq_weight(self, layer: nn.Module) -> QuantWeight:
        bits = self.scheme.bits
        codes = _unpack_int32(layer.qweight.data, bits, 0).t()  # [N, K]
        zeros = _unpack_int32(layer.qzeros.data, bits, 1).t()  # [N, G]
        if self.scheme.zeros_minus_one:
            zeros = zeros + 1
        scales = layer.scales.data.t().float()
        group = self._group_size(codes.shape[1])
        if bits == 8:  # unsigned codes, shifted to int8
            zeros = zeros - 128
            return QuantWeight(
                "int8", (codes - 128).to(torch.int8), scales.contiguous(),
                zeros.float().contiguous() if zeros.any() else None, group)
        return QuantWeight("int4", codes.to(torch.int8).contiguous(),
                           scales.contiguous(), zeros.float().contiguous(),
                           group)

    def _group_size(self, in_features: int) -> int:
        group = self.scheme.group_size
        return in_features if group == -1 else group

    def _fp8_weight(self, layer: nn.Module) -> QuantWeight:
        scale = layer.weight_scale.data.float()
        if self.scheme.strategy == "tensor":
            # One scale per fused shard (q, k and v, or gate and up).
            scale = torch.cat([
                s.expand(width)
                for s, width in zip(scale.view(-1), layer.logical_widths)
            ]).view(-1, 1)
        if self.scheme.activations == "static":
            inputs = layer.input_scale.data.float().view(-1)
            if inputs.numel() > 1 and not torch.all(inputs == inputs[0]):
                logger.warning(
                    "The fused shards of a layer have input scales %s; "
                    "its one input is quantized with the largest",
                    inputs.tolist())
            layer.spyre_input_scale = inputs.max().reshape(1)
            _free(layer, "input_scale")
        return QuantWeight("fp8", layer.weight.data.contiguous(),
                           scale.contiguous())

    def _int_weight(self, layer: nn.Module) -> QuantWeight:
        bits = self.scheme.bits
        codes = _unpack_int32(layer.weight_packed.data, bits, 1)  # unsigned
        scales = layer.weight_scale.data.float().contiguous()
        offset = 1 << (bits - 1)
        group = self._group_size(codes.shape[1])
        if bits == 8:
            return QuantWeight("int8", (codes - offset).to(torch.int8),
                               scales, None, group)
        return QuantWeight("int4", codes.to(torch.int8), scales,
                           torch.full_like(scales, float(offset)), group)

    def finish(self, layer: nn.Module, native: bool,
               round_inputs: bool = False) -> None:
        """Packs the layer for the quantized kernel (``native``), or, off
        the kernels, keeps its weight dequantized in float32.
        ``round_inputs`` (the bfloat16 precision): the kernel rounds the
        inputs to bfloat16, as the precision's other products do."""
        weight: QuantWeight = layer.spyre_quant
        if native:
            packed = pack(weight)
            layer.register_buffer("spyre_qcodes", packed.packed,
                                  persistent=False)
            layer.register_buffer("spyre_qscales", packed.scales,
                                  persistent=False)
            layer.register_buffer("spyre_qoffsets", packed.offsets,
                                  persistent=False)
            layer.spyre_qkind = packed.kind
            layer.spyre_qgroup = packed.group_size
            layer.spyre_qround = round_inputs
            layer.spyre_out_features = packed.out_features
        else:
            layer.register_buffer("spyre_dequantized", weight.dequantize(),
                                  persistent=False)
        del layer.spyre_quant

    def weight_bytes(self, layer: nn.Module) -> int:
        """Bytes the layer's weight is held in."""
        return sum(
            b.numel() * b.element_size()
            for b in (getattr(layer, n, None)
                      for n in ("spyre_qcodes", "spyre_qscales",
                                "spyre_qoffsets", "spyre_dequantized"))
            if b is not None)

    # -- forward ----------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor,
              bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.scheme.activations is not None:
            x = fake_quantize_fp8(x, getattr(layer, "spyre_input_scale",
                                             None))
        if hasattr(layer, "spyre_qcodes"):
            return torch.ops.spyre_cpu.quant_linear(
                x, layer.spyre_qcodes, layer.spyre_qscales,
                layer.spyre_qoffsets, layer.spyre_qkind, layer.spyre_qgroup,
                layer.spyre_out_features, bias, layer.spyre_qround)
        return F.linear(x, layer.spyre_dequantized.to(x.dtype), bias)

    # A quantized output head is applied like a linear layer; its tokens
    # are looked up in the (unquantized) token embedding.
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "a quantized output head tied to the token embedding is not "
            "supported on Spyre")


def finish_quantized_layers(model: nn.Module, native: bool,
                            round_inputs: bool = False) -> int:
    """``SpyreQuantLinearMethod.finish`` on every quantized layer of
    ``model``; returns how many."""
    done = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, SpyreQuantLinearMethod) and \
                hasattr(module, "spyre_quant"):
            method.finish(module, native, round_inputs)
            done += 1
    return done


_installed = False


def install() -> None:
    """The ``vllm.general_plugins`` entry point: registers ``spyre`` as a
    vLLM quantization method (once per process), and loads its layers'
    tensors with the parameter-aware loaders."""
    global _installed
    if _installed:
        return
    from vllm.model_executor.layers.quantization import (
        QUANTIZATION_METHODS, register_quantization_config)
    if NAME not in QUANTIZATION_METHODS:
        register_quantization_config(NAME)(SpyreQuantConfig)
    if SpyreQuantLinearMethod.__name__ not in \
            vllm_linear.WEIGHT_LOADER_V2_SUPPORTED:
        vllm_linear.WEIGHT_LOADER_V2_SUPPORTED.append(
            SpyreQuantLinearMethod.__name__)
    _installed = True

