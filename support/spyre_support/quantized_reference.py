"""The float model a quantized checkpoint of
``vllm/model_executor/layers/quantization/spyre_quant_writer.py`` stands
for, the tests' reference: ``dequantized_state_dict`` (GPTQ unpacked by
its specification, compressed-tensors through the library's own
decompression), ``activation_quant`` and ``reference_model`` (a float32
transformers model of those weights which fake-quantizes FP8 inputs the
format's way)."""
from __future__ import annotations

from pathlib import Path

import torch

from vllm.model_executor.layers.quantization.spyre_quant_files import (
    AUX_SUFFIXES, load_tensors, output_head_name, plain_config, read_config,
    skeleton)

#: Largest magnitude of float8 e4m3fn.
FP8_MAX = 448.0


def _unpack_gptq(packed: torch.Tensor, bits: int, along_rows: bool):
    """Unpack GPTQ's int32 words into unsigned ``bits``-bit codes: along
    the rows (qweight: [R, C] -> [R * 32/bits, C]) or the columns (qzeros:
    [R, C] -> [R, C * 32/bits]); code j of a word sits at bit ``bits*j``."""
    mask = (1 << bits) - 1
    words = packed.to(torch.int64) & 0xFFFFFFFF
    codes = [(words >> (bits * j)) & mask for j in range(32 // bits)]
    if along_rows:
        stacked = torch.stack(codes, dim=1)          # [R, 32/bits, C]
        return stacked.reshape(-1, packed.shape[1])
    stacked = torch.stack(codes, dim=2)              # [R, C, 32/bits]
    return stacked.reshape(packed.shape[0], -1)


def _gptq_dequantized(folder: Path, config: dict):
    qc = config["quantization_config"]
    bits = int(qc["bits"])
    tensors = load_tensors(folder)
    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".qweight"):
            prefix = name[:-len(".qweight")]
            codes = _unpack_gptq(tensor, bits, along_rows=True)   # [K, N]
            zeros = _unpack_gptq(tensors[f"{prefix}.qzeros"], bits,
                                 along_rows=False) + 1           # [G, N]
            scales = tensors[f"{prefix}.scales"].to(torch.float32)
            g_idx = tensors[f"{prefix}.g_idx"].to(torch.int64)
            n_out = scales.shape[1]
            codes, zeros = codes[:, :n_out], zeros[:, :n_out]
            w = (codes[:g_idx.numel()] - zeros[g_idx]).to(torch.float32) \
                * scales[g_idx]
            result[f"{prefix}.weight"] = w.t().contiguous()
        elif not name.endswith(AUX_SUFFIXES):
            result[name] = (tensor.to(torch.float32)
                            if tensor.is_floating_point() else tensor)
    return result


def _ct_names_to_scheme(folder: Path, quant_config):
    """Quantized module name -> scheme, matched by compressed-tensors
    itself on a meta-device model of the folder's config."""
    from compressed_tensors.quantization import (QuantizationStatus,
                                                 apply_quantization_config)
    qc = quant_config.model_copy(deep=True)
    qc.quantization_status = QuantizationStatus.INITIALIZED
    return apply_quantization_config(skeleton(plain_config(folder)), qc)


def _ct_dequantized(folder: Path):
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained(str(folder))
    names_to_scheme = _ct_names_to_scheme(folder,
                                          compressor.quantization_config)
    result: dict[str, torch.Tensor] = {}
    for module, data in compressor.quantization_compressor.decompress(
            str(folder), names_to_scheme=names_to_scheme):
        result[f"{module}.weight"] = data["weight"].to(torch.float32)
    for name, tensor in load_tensors(folder).items():
        if name in result or name.endswith(AUX_SUFFIXES):
            continue
        result[name] = (tensor.to(torch.float32)
                        if tensor.is_floating_point() else tensor)
    return result


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The float32 state dict, under the float model's names, that the
    quantized checkpoint ``folder`` stands for: every quantized linear's
    ``weight`` dequantized, every other stored tensor upcast; quantization
    parameters (scales, zero points, ...) left out.  A tied output head
    stays absent, as in the float checkpoint's file."""
    folder = Path(folder)
    config = read_config(folder)
    method = config.get("quantization_config", {}).get("quant_method")
    if method == "gptq":
        return _gptq_dequantized(folder, config)
    if method == "compressed-tensors":
        return _ct_dequantized(folder)
    raise ValueError(f"{folder}: not a quantized checkpoint of the writer "
                     f"(quant_method {method!r})")


def activation_quant(folder: Path) -> dict:
    """Per quantized linear (HF module name), how its input is quantized:
    ``("static", scale)`` (a float32 tensor of shape [1]) or
    ``("dynamic", None)``; ``{}`` for weight-only checkpoints."""
    folder = Path(folder)
    qc = read_config(folder).get("quantization_config", {})
    if qc.get("quant_method") != "compressed-tensors":
        return {}
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained(str(folder))
    names_to_scheme = _ct_names_to_scheme(folder,
                                          compressor.quantization_config)
    tensors = None
    result = {}
    for name, scheme in sorted(names_to_scheme.items()):
        args = scheme.input_activations
        if args is None:
            continue
        if args.dynamic:
            result[name] = ("dynamic", None)
        else:
            if tensors is None:
                tensors = load_tensors(folder)
            result[name] = ("static",
                            tensors[f"{name}.input_scale"].to(torch.float32))
    return result


def _fp8_round(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    q = torch.clamp(x / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.to(x.dtype) * scale


def _static_hook(scale: torch.Tensor):
    def hook(_module, args):
        return (_fp8_round(args[0], scale.to(args[0].dtype)), *args[1:])
    return hook


def _dynamic_hook(_module, args):
    x = args[0]
    scale = x.abs().amax(dim=-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return (_fp8_round(x, scale), *args[1:])


def reference_model(folder: Path):
    """A float32 transformers model of ``folder``'s dequantized weights;
    for FP8 formats each quantized ``nn.Linear`` fake-quantizes its input
    (a forward pre-hook): static, ``clamp(x / s, -448, 448)`` rounded to
    float8 e4m3 and times ``s``; dynamic, the same with ``s`` the absmax
    of each row (last dimension) / 448 (1 where the row is zero), as
    vLLM's kernels quantize.  (compressed-tensors' own fake quantization
    of "token" inputs reduces over the batch dimension only: a scale per
    element of a [1, T, H] input, so transformers running an
    ``fp8-dynamic`` checkpoint leaves its inputs in effect unquantized.)"""
    from transformers import AutoModelForCausalLM
    folder = Path(folder)
    config = plain_config(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dequantized_state_dict(folder)
    if config.tie_word_embeddings:
        # The head is the token embedding; a head tensor the file holds
        # anyway is ignored, as transformers and vLLM ignore it.
        state.pop(f"{output_head_name(model)}.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        head = f"{output_head_name(model)}.weight"
        missing = [k for k in missing if k != head]
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"{folder}: missing {missing}, "
                           f"unexpected {unexpected}")
    for name, (kind, scale) in activation_quant(folder).items():
        module = model.get_submodule(name)
        module.register_forward_pre_hook(
            _static_hook(scale) if kind == "static" else _dynamic_hook)
    return model.eval()
