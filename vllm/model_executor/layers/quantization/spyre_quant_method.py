"""One quantized linear layer (or output head) of vLLM's model code on
Spyre: ``SpyreQuantLinearMethod``, installed by ``spyre_quant``'s
``SpyreQuantConfig``.

It creates the checkpoint's tensors with vLLM's parameter classes, so the
layers' own weight loaders shard codes, scales and zero points under
tensor parallelism and fill fused layers shard by shard; after loading it
turns them into one ``QuantWeight``; ``finish`` puts that on the quantized
kernel (``spyre_quant_linear``) or dequantizes it once.  8- and 4-bit
integer codes, where each layer goes on the kernel as it loads, are laid
out for it straight from their int32 words instead (``pack_words``).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from vllm.logger import init_logger
from vllm.model_executor.layers.linear import LinearMethodBase
from vllm.model_executor.layers.quantization.spyre_quant_schemes import (
    Scheme)
from vllm.model_executor.layers.quantization.spyre_quant_linear import (
    KIND_NAMES, PackedQuant, QuantWeight, fake_quantize_fp8, integer_rows,
    kernel_rows, pack, pack_words, unpack_int32)
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
from vllm.spyre_kernels import ops

logger = init_logger(__name__)


def _free(layer: nn.Module, *names: str) -> None:
    for name in names:
        if hasattr(layer, name):
            delattr(layer, name)


class SpyreQuantLinearMethod(LinearMethodBase):
    """One quantized linear layer (or output head) of vLLM's model code."""

    def __init__(self, config, scheme: Scheme) -> None:
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
        if self.config.finish_options is not None:
            self.finish(layer, *self.config.finish_options)

    def _packs_words(self) -> bool:
        """8- and 4-bit integer codes laid out for the kernel straight from
        their words: where each layer goes on the kernels as it loads."""
        options = self.config.finish_options
        return (self.scheme.bits in (8, 4) and options is not None
                and options[0] and ops.loaded())

    def _gptq_weight(self,
                     layer: nn.Module) -> Union[QuantWeight, PackedQuant]:
        bits = self.scheme.bits
        zeros = unpack_int32(layer.qzeros.data, bits, 1).t().to(
            torch.int32)  # [N, G]
        if self.scheme.zeros_minus_one:
            zeros = zeros + 1
        scales = layer.scales.data.t().float().contiguous()
        group = self._group_size(layer.qweight.shape[0] * 32 // bits)
        if bits == 8:  # unsigned codes, shifted to int8
            zeros = zeros - 128
        # int8: none where all are 0 (symmetric).
        zeros = zeros.float().contiguous() if bits == 4 or zeros.any() \
            else None
        if self._packs_words():
            return pack_words(layer.qweight.data, bits, 0, scales, zeros,
                              group)
        codes = unpack_int32(layer.qweight.data, bits, 0).t()  # [N, K]
        if bits == 8:
            # code - 128 as int8: the code's top bit flipped, in place
            # (the codes are the unpacking's own tensor).
            return QuantWeight("int8",
                               codes.bitwise_xor_(128).view(torch.int8),
                               scales, zeros, group)
        return QuantWeight("int4", codes.view(torch.int8), scales, zeros,
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

    def _int_weight(self,
                    layer: nn.Module) -> Union[QuantWeight, PackedQuant]:
        bits, words = self.scheme.bits, layer.weight_packed.data
        scales = layer.weight_scale.data.float().contiguous()
        group = self._group_size(words.shape[1] * 32 // bits)
        # Unsigned codes: int8 with the top bit flipped; int4 around 8.
        zeros = None if bits == 8 else torch.full_like(
            scales, float(1 << (bits - 1)))
        if self._packs_words():
            return pack_words(words, bits, 1, scales, zeros, group)
        codes = unpack_int32(words, bits, 1)
        if bits == 8:
            codes = codes ^ 128
        return QuantWeight("int8" if bits == 8 else "int4",
                           codes.view(torch.int8), scales, zeros, group)

    def finish(self, layer: nn.Module, native: bool,
               round_inputs: bool = False) -> None:
        """Packs the layer for the quantized kernel (``native``), or, off
        the kernels, keeps its weight dequantized in float32.
        ``round_inputs`` (the bfloat16 precision): the kernel rounds the
        inputs to bfloat16, as the precision's other products do."""
        weight = layer.spyre_quant
        if native:
            # Integer codes may be packed already, as read (_packs_words).
            packed = weight if isinstance(weight, PackedQuant) else \
                pack(weight)
            kind = KIND_NAMES[packed.kind]
            layer.register_buffer("spyre_qcodes", packed.packed,
                                  persistent=False)
            layer.register_buffer("spyre_qscales", packed.scales,
                                  persistent=False)
            layer.register_buffer("spyre_qoffsets", packed.offsets,
                                  persistent=False)
            layer.spyre_qkind = packed.kind
            layer.spyre_qzero = packed.zero_point
            layer.spyre_qgroup = packed.group_size
            layer.spyre_qround = round_inputs
            # A prompt's rounded inputs on oneDNN's AMX tiles, or tiles of
            # bfloat16 pairs, as this CPU multiplies them faster.
            layer.spyre_qdense, layer.spyre_qdot = kernel_rows(kind,
                                                               round_inputs)
            layer.spyre_qint = integer_rows(kind, round_inputs)
            layer.spyre_out_features = packed.out_features
        else:
            layer.register_buffer("spyre_dequantized", weight.dequantize(),
                                  persistent=False)
        del layer.spyre_quant

    @staticmethod
    def finished(layer: nn.Module) -> bool:
        """Whether ``finish`` has put the layer on its kernel or path."""
        return hasattr(layer, "spyre_qkind") or hasattr(
            layer, "spyre_dequantized")

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
            return torch.ops.spyre_kernels.quant_linear(
                x, layer.spyre_qcodes, layer.spyre_qscales,
                layer.spyre_qoffsets, layer.spyre_qkind,
                layer.spyre_qgroup, layer.spyre_out_features,
                layer.spyre_qzero, bias, layer.spyre_qround,
                layer.spyre_qdense, layer.spyre_qdot, layer.spyre_qint)
        return F.linear(x, layer.spyre_dequantized.to(x.dtype), bias)

    # A quantized output head is applied like a linear layer; its tokens
    # are looked up in the (unquantized) token embedding.
    def embedding(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(
            "a quantized output head tied to the token embedding is not "
            "supported on Spyre")
