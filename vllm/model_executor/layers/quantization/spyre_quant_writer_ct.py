"""The compressed-tensors formats of the quantized-checkpoint writer
(``fp8``, ``fp8-dynamic``, ``w8a16``, ``w4a16``; the format specification
is ``spyre_quant_writer``'s docstring): made with the installed
compressed-tensors library, weight scales from the weights' min and max,
the static FP8 input scale calibrated on a text."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from vllm.model_executor.layers.quantization.spyre_quant_files import (
    decoder_linears, input_embedding_name, load_tensors, output_head_name,
    plain_config, read_config, skeleton)

#: compressed-tensors format -> (preset scheme, compression format).
CT_SCHEMES = {
    "fp8": ("FP8", "float-quantized"),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"),
    "w8a16": ("W8A16", "pack-quantized"),
    "w4a16": ("W4A16", "pack-quantized"),
}

#: The calibration text when none is given.
FALLBACK_TEXT = (
    "A lighthouse stands on the last rock before the sea and turns its "
    "light all night, so that ships far out can tell where the coast is. "
    "The keeper trims the wick, winds the clockwork, writes the weather in "
    "a log and watches the horizon until the morning comes.")


def calibration_text(calibration: str | None) -> str:
    """``calibration`` read as a file, or taken as the text itself, or
    ``FALLBACK_TEXT``."""
    if calibration is None:
        return FALLBACK_TEXT
    path = Path(calibration)
    try:
        if path.is_file():
            return path.read_text()
    except OSError:  # e.g. a text too long to be a file name
        pass
    return calibration


def _ct_scheme(fmt: str, group_size: int | None):
    from compressed_tensors.quantization import (QuantizationStrategy,
                                                 preset_name_to_scheme)
    scheme = preset_name_to_scheme(CT_SCHEMES[fmt][0], ["Linear"])
    if group_size is None:
        return scheme
    if fmt.startswith("fp8"):
        raise ValueError(f"{fmt} has no weight groups (got group size "
                         f"{group_size})")
    if group_size == -1:
        scheme.weights.strategy = QuantizationStrategy.CHANNEL
        scheme.weights.group_size = None
    elif group_size > 0:
        scheme.weights.strategy = QuantizationStrategy.GROUP
        scheme.weights.group_size = group_size
    else:
        raise ValueError(f"bad group size {group_size}")
    return scheme


def _weight_min_max(weight: torch.Tensor, args):
    """Min and max of ``weight`` [N, K] per the strategy of ``args``, in the
    shapes compressed-tensors keeps its weight scales in."""
    from compressed_tensors.quantization import QuantizationStrategy
    w = weight.detach()
    strategy = args.strategy
    if strategy == QuantizationStrategy.TENSOR:
        return w.amin(), w.amax()
    if strategy == QuantizationStrategy.CHANNEL:
        return w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
    if strategy == QuantizationStrategy.GROUP:
        n_out, k_in = w.shape
        g = w.reshape(n_out, k_in // args.group_size, args.group_size)
        return g.amin(dim=-1), g.amax(dim=-1)
    raise ValueError(f"unsupported weight strategy {strategy}")


def _set_param(module, name: str, value: torch.Tensor) -> None:
    param = getattr(module, name)
    if param.shape != value.shape:
        raise RuntimeError(f"{name}: shape {tuple(value.shape)} != "
                           f"{tuple(param.shape)}")
    param.data.copy_(value.to(param.dtype))


@torch.no_grad()
def _calibrate_inputs(model, tokenizer, names: list[str], text: str,
                      chunk: int = 256, chunks: int = 4):
    """Min and max of each named module's input over ``text``, run in
    ``chunks`` windows of ``chunk`` tokens through ``model``."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False,
                    return_tensors="pt")["input_ids"][0]
    if ids.numel() == 0:
        raise ValueError("empty calibration text")
    limit = getattr(model.config, "max_position_embeddings", chunk) or chunk
    chunk = min(chunk, limit)
    stats: dict[str, list[torch.Tensor]] = {}

    def recorder(name):
        def hook(_module, args):
            lo, hi = torch.aminmax(args[0].detach())
            if name in stats:
                stats[name] = [torch.minimum(stats[name][0], lo),
                               torch.maximum(stats[name][1], hi)]
            else:
                stats[name] = [lo, hi]
        return hook

    handles = [model.get_submodule(n).register_forward_pre_hook(recorder(n))
               for n in names]
    try:
        for start in range(0, min(ids.numel(), chunk * chunks), chunk):
            window = ids[start:start + chunk]
            model(input_ids=window[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return stats


def write(src: Path, out: Path, fmt: str, group_size: int | None,
          sym: bool, lm_head: bool, calibration: str | None) -> None:
    """Writes ``src`` in the compressed-tensors format ``fmt`` to ``out``:
    a tensor at a time (``write_streamed``) unless the format calibrates
    static input scales (``fp8``), which runs the whole float model."""
    if not sym:
        raise ValueError(f"{fmt}: only symmetric weights are offered "
                         "(compressed-tensors 0.10.2 cannot decompress "
                         "packed asymmetric zero points)")
    scheme = _ct_scheme(fmt, group_size)
    inputs = scheme.input_activations
    if inputs is None or inputs.dynamic:
        write_streamed(src, out, fmt, scheme, lm_head)
    else:
        _write_calibrated(src, out, fmt, scheme, lm_head, calibration)


def _check_groups(model, head: str, lm_head: bool,
                  group: int | None) -> None:
    """Every layer to quantize takes whole groups of ``group`` inputs."""
    if group is not None and group > 0:
        for name in decoder_linears(model) + ([head] if lm_head else []):
            k_in = model.get_submodule(name).in_features
            if k_in % group:
                raise ValueError(f"{name}: input size {k_in} is not a "
                                 f"multiple of group size {group}")


def _quantize_modules(model, scheme, head: str, lm_head: bool) -> dict:
    """Applies ``scheme`` to ``model``'s linear layers (the head too with
    ``lm_head``); returns the quantized modules by name."""
    from compressed_tensors.quantization import (QuantizationConfig,
                                                 apply_quantization_config)
    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=[] if lm_head else [head])
    apply_quantization_config(model, config)
    return {n: m for n, m in model.named_modules()
            if getattr(m, "quantization_scheme", None) is not None}


def write_streamed(src: Path, out: Path, fmt: str, scheme,
                   lm_head: bool) -> None:
    """The formats without calibrated inputs, never holding the float
    model: the model's skeleton (meta device) takes the scheme, which
    gives the compressor and the config; then each weight is read from
    ``src``, its scales computed as ``_write_calibrated`` computes them
    (min and max, ``calculate_qparams``, in the weight's dtype) and
    compressed alone by the same compressor, so the tensors are the
    whole-model path's.  One ``model.safetensors``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import save_file

    config = read_config(src)
    meta = skeleton(plain_config(src))
    tensors = load_tensors(src)
    head = output_head_name(meta)
    if lm_head and f"{head}.weight" not in tensors:  # untie the head
        tensors[f"{head}.weight"] = tensors[
            f"{input_embedding_name(meta)}.weight"]
        config["tie_word_embeddings"] = False
    _check_groups(meta, head, lm_head, scheme.weights.group_size)
    quantized = _quantize_modules(meta, scheme, head, lm_head)
    for module in quantized.values():
        module.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(
        meta, quantization_format=CT_SCHEMES[fmt][1])
    schemes = {n: m.quantization_scheme for n, m in quantized.items()}

    result: dict[str, torch.Tensor] = {}
    for name in list(tensors):
        tensor = tensors[name]
        prefix, _, leaf = name.rpartition(".")
        if prefix not in quantized or leaf != "weight":
            result[name] = tensor
            continue
        args = schemes[prefix].weights
        scale, zero_point = calculate_qparams(
            *_weight_min_max(tensor, args), args)
        state = {name: tensor,
                 f"{prefix}.weight_scale": scale.to(tensor.dtype)}
        if hasattr(quantized[prefix], "weight_zero_point"):
            state[f"{prefix}.weight_zero_point"] = zero_point.to(
                quantized[prefix].weight_zero_point.dtype)
        result.update(compressor.quantization_compressor.compress(
            state, schemes))
        del tensors[name]
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in result.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # As ModelCompressor.compress marks a compressed (non-dense) format.
    compressor.quantization_config.quantization_status = \
        QuantizationStatus.COMPRESSED
    compressor.update_config(str(out))


def _write_calibrated(src: Path, out: Path, fmt: str, scheme, lm_head: bool,
                      calibration: str | None) -> None:
    """The whole float model, its static input scales calibrated on a
    text, compressed by compressed-tensors' ``ModelCompressor``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationStatus
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    head = output_head_name(model)
    if lm_head and model.config.tie_word_embeddings:
        out_emb = model.get_output_embeddings()
        out_emb.weight = torch.nn.Parameter(
            model.get_input_embeddings().weight.detach().clone(),
            requires_grad=False)
        model.config.tie_word_embeddings = False
    _check_groups(model, head, lm_head, scheme.weights.group_size)
    quantized = _quantize_modules(model, scheme, head, lm_head)

    for module in quantized.values():
        args = module.quantization_scheme.weights
        lo, hi = _weight_min_max(module.weight, args)
        scale, zero_point = calculate_qparams(lo, hi, args)
        _set_param(module, "weight_scale", scale)
        if hasattr(module, "weight_zero_point"):
            _set_param(module, "weight_zero_point", zero_point)

    static = [n for n, m in quantized.items()
              if m.quantization_scheme.input_activations is not None
              and not m.quantization_scheme.input_activations.dynamic]
    if static:
        # Calibrate on the float model: compressed-tensors' own switch
        # turns its fake quantization off.
        for module in quantized.values():
            module.quantization_enabled = False
        stats = _calibrate_inputs(model, AutoTokenizer.from_pretrained(src),
                                  static, calibration_text(calibration))
        for module in quantized.values():
            del module.quantization_enabled
        for name in static:
            module = quantized[name]
            if name not in stats:
                raise RuntimeError(f"{name} saw no calibration input")
            args = module.quantization_scheme.input_activations
            scale, zero_point = calculate_qparams(*stats[name], args)
            _set_param(module, "input_scale", scale)
            if hasattr(module, "input_zero_point"):
                _set_param(module, "input_zero_point", zero_point)

    for module in quantized.values():
        module.quantization_status = QuantizationStatus.FROZEN

    compressor = ModelCompressor.from_pretrained_model(
        model, quantization_format=CT_SCHEMES[fmt][1])
    state_dict = compressor.compress(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, state_dict=state_dict, safe_serialization=True)
    compressor.update_config(str(out))
