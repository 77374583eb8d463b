"""Write quantized Hugging Face checkpoints of a float Llama-family folder.

Formats (``FORMATS``):

``gptq-int4``, ``gptq-int8``
    The GPTQ v1 checkpoint layout (``checkpoint_format: "gptq"``, as
    AutoGPTQ and GPTQModel save it), written here by that layout's
    specification because GPTQ's own tools do not install in this
    environment.  The weights are quantized by round-to-nearest (RTN): no
    calibration and no Hessian-based error correction, so the file has
    GPTQ's layout but not GPTQ's accuracy.  Every ``nn.Linear`` of the
    decoder layers is quantized (the output head too with ``lm_head``);
    embeddings and norms stay float.  Per quantized linear ``<p>`` with
    weight ``W`` of shape [N, K] (out, in) and G groups (``ceil(K /
    group_size)``, the last one shorter where K is not a multiple, as
    GPTQ's tools write them; 1 for group_size -1):

    * ``<p>.qweight`` int32 [K * bits / 32, N]: the codes ``q[k, n]``
      packed along the input dimension; int32 row i holds input rows
      ``i * (32 / bits) + j`` at bit offset ``bits * j``;
    * ``<p>.qzeros`` int32 [G, N * bits / 32]: the zero points *minus one*
      (GPTQ v1), packed along the output dimension the same way;
    * ``<p>.scales`` float16 [G, N];
    * ``<p>.g_idx`` int32 [K] = ``k // group_size`` (all 0 for -1);
    * ``<p>.bias`` float16, when the layer has one.

    ``W[n, k] = scales[g, n] * (q[k, n] - zero[g, n])`` with
    ``g = g_idx[k]``.  The rule, per group of a row (GPTQ's quantizer with
    ``maxq = 2**bits - 1``):

    * symmetric: ``max = absmax(group)``, ``min = -max``,
      ``scale = (max - min) / maxq``, ``zero = 2**(bits - 1)`` (stored as
      7 for 4 bits, 127 for 8 bits);
    * asymmetric: ``min = min(group, 0)``, ``max = max(group, 0)``,
      ``scale = (max - min) / maxq``, ``zero = round(-min / scale)``
      clamped to [1, maxq] (v1 stores ``zero - 1`` in ``bits`` bits, so 0
      cannot be stored; a group whose minimum is 0 is the rare victim);
    * an all-zero group takes ``min = -1, max = 1`` (as GPTQ does);
    * ``q = clamp(round(w / scale) + zero, 0, maxq)``, ``scale`` taken
      after its rounding to float16 (the stored value).

    Every other tensor is saved in float16 and the config says
    ``torch_dtype: "float16"``, as GPTQ's tools write; the config's
    ``quantization_config`` is ``{"bits", "group_size", "damp_percent":
    0.01, "desc_act": false, "static_groups": false, "sym",
    "true_sequential": true, "lm_head", "quant_method": "gptq",
    "checkpoint_format": "gptq"}`` (also written to ``quantize_config.json``,
    as AutoGPTQ does).

``fp8``, ``fp8-dynamic``, ``w8a16``, ``w4a16``
    compressed-tensors checkpoints, made with the installed
    compressed-tensors library (the one llm-compressor writes them with):
    its preset schemes ``FP8`` (FP8 weights per tensor, static per-tensor
    FP8 input scale), ``FP8_DYNAMIC`` (FP8 weights per output channel,
    dynamic per-token inputs), ``W8A16`` (int8 symmetric per-channel
    weights) and ``W4A16`` (int4 symmetric, groups of 128) targeting
    ``Linear``, applied with ``apply_quantization_config``; the weight
    scales come from the weights' min/max through compressed-tensors'
    ``calculate_qparams`` (what llm-compressor's min-max observer feeds
    it; symmetric int: ``scale = absmax / ((2**bits - 1) / 2)``, FP8:
    ``absmax / 448``); ``ModelCompressor`` compresses the state dict
    (``float-quantized`` for FP8, ``pack-quantized`` for the int formats,
    llm-compressor's choices) and writes the config.  Per quantized linear
    ``<p>`` (weight [N, K]): FP8 ``<p>.weight`` float8_e4m3fn [N, K],
    ``<p>.weight_scale`` [1] (``fp8``) or [N, 1] (``fp8-dynamic``),
    ``<p>.input_scale`` [1] (``fp8`` only); W8A16/W4A16
    ``<p>.weight_packed`` int32 [N, K * bits / 32] (code + 2**(bits - 1),
    unsigned, input k at bit ``bits * (k % (32 / bits))`` of word
    ``k // (32 / bits)``), ``<p>.weight_scale`` [N, 1] or [N, K / 128],
    ``<p>.weight_shape`` int64 [2] = (N, K); scales in the source's
    dtype, symmetric zero points not stored.  The ``fp8`` input
    scale is calibrated on the float model (quantization disabled) over a
    fixed text, its first 1024 tokens in 4 windows of 256:
    ``calculate_qparams`` of each input's min and max over them, i.e.
    ``absmax(input) / 448``.  The text is ``--calibration`` (a
    file, or the text itself), else ``scripts/text.txt``, else
    ``benchmarks/data/text.txt``, else a built-in paragraph.  The output
    head is ignored (``"ignore": ["lm_head"]``) unless ``lm_head``.  Other
    tensors keep the source's dtype.  ``group_size`` may override the int
    formats' grouping (-1: per channel); only symmetric weights are
    offered, compressed-tensors 0.10.2 cannot decompress packed
    asymmetric zero points.

A tied output head (SmolLM2's) that is to be quantized is untied first: the
checkpoint then holds a float embedding and a quantized head, and says
``tie_word_embeddings: false``.

For tests: ``dequantized_state_dict`` (the float weights a checkpoint
stands for: GPTQ unpacked by its specification, compressed-tensors through
the library's own decompression), ``activation_quant`` and
``reference_model`` (a float32 transformers model of those weights which
fake-quantizes FP8 inputs the format's way).

Usage:
  python scripts/quantize.py --model models/SmolLM2-135M-Instruct \\
      --format gptq-int4 --out /tmp/smollm2-gptq-int4 \\
      [--group-size N] [--asym] [--lm-head] [--calibration FILE]
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import time
from pathlib import Path

import torch

FORMATS = ("gptq-int4", "gptq-int8", "fp8", "fp8-dynamic", "w8a16", "w4a16")

#: GPTQ format -> bits.
GPTQ_BITS = {"gptq-int4": 4, "gptq-int8": 8}

#: compressed-tensors format -> (preset scheme, compression format).
CT_SCHEMES = {
    "fp8": ("FP8", "float-quantized"),
    "fp8-dynamic": ("FP8_DYNAMIC", "float-quantized"),
    "w8a16": ("W8A16", "pack-quantized"),
    "w4a16": ("W4A16", "pack-quantized"),
}

#: Largest magnitude of float8 e4m3fn.
FP8_MAX = 448.0

#: Files copied verbatim from the source folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "generation_config.json")

_REPO = Path(__file__).resolve().parent.parent
_CALIBRATION_FILES = (_REPO / "scripts" / "text.txt",
                      _REPO / "benchmarks" / "data" / "text.txt")
_FALLBACK_TEXT = (
    "A lighthouse stands on the last rock before the sea and turns its "
    "light all night, so that ships far out can tell where the coast is. "
    "The keeper trims the wick, winds the clockwork, writes the weather in "
    "a log and watches the horizon until the morning comes.")

#: Tensor-name suffixes of quantization parameters (not float weights).
_AUX_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx",
                 ".weight_packed", ".weight_scale", ".weight_zero_point",
                 ".weight_shape", ".weight_g_idx", ".weight_global_scale",
                 ".input_scale", ".input_zero_point",
                 ".input_global_scale", ".output_scale",
                 ".output_zero_point")

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


# --------------------------------------------------------------- helpers --

def _read_config(folder: Path) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


class _LazyTensors(dict):
    """name -> tensor of a folder's safetensors files, each read when it is
    asked for, so that quantizing a model larger than the machine's memory
    never holds all of its float tensors at once.  A tensor set by hand
    (an untied head) is held as given."""

    def __init__(self, files: dict[str, Path]) -> None:
        super().__init__(files)

    def __getitem__(self, name: str) -> torch.Tensor:
        value = super().__getitem__(name)
        if not isinstance(value, Path):
            return value
        from safetensors import safe_open
        with safe_open(str(value), framework="pt") as f:
            return f.get_tensor(name)

    def items(self):
        return ((name, self[name]) for name in self.keys())

    def values(self):
        return (self[name] for name in self.keys())


def _load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    return _LazyTensors(where)


def _plain_config(folder: Path):
    """The folder's transformers config without its quantization config."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def _skeleton(config):
    """The model of ``config`` on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _output_head_name(model) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


def _input_embedding_name(model) -> str:
    emb = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is emb)


def _decoder_linears(model) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and _DECODER_LAYER.search(n)]


def _copy_side_files(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


def _calibration_text(calibration: str | None) -> str:
    if calibration is not None:
        path = Path(calibration)
        try:
            if path.is_file():
                return path.read_text()
        except OSError:  # e.g. a text too long to be a file name
            pass
        return calibration
    for path in _CALIBRATION_FILES:
        if path.is_file():
            return path.read_text()
    return _FALLBACK_TEXT


# ------------------------------------------------------------ GPTQ writer --

def _gptq_rtn(weight: torch.Tensor, bits: int, group_size: int, sym: bool):
    """RTN codes [N, K] (int64), float16 scales [N, G], zero points [N, G]
    (int64) of ``weight`` [N, K] under GPTQ's rule (module docstring)."""
    n_out, k_in = weight.shape
    group = k_in if group_size == -1 else group_size
    groups = -(-k_in // group)  # a last group may be shorter, as GPTQ's
    maxq = 2**bits - 1
    # Zeros pad the last group: they change neither its min (<= 0) nor
    # its max (>= 0), and their codes are dropped.
    w = torch.nn.functional.pad(weight.to(torch.float32),
                                (0, groups * group - k_in))
    w = w.reshape(n_out, groups, group)
    zero_t = torch.zeros((), dtype=torch.float32)
    wmin = torch.minimum(w.amin(dim=-1), zero_t)
    wmax = torch.maximum(w.amax(dim=-1), zero_t)
    if sym:
        wmax = torch.maximum(wmax, -wmin)
        wmin = -wmax
    empty = (wmin == 0) & (wmax == 0)
    wmin = torch.where(empty, -1.0, wmin)
    wmax = torch.where(empty, 1.0, wmax)
    scale16 = ((wmax - wmin) / maxq).to(torch.float16)
    scale = scale16.to(torch.float32)
    if sym:
        zero = torch.full_like(scale, 2**(bits - 1))
    else:
        zero = torch.clamp(torch.round(-wmin / scale), 1, maxq)
    codes = torch.clamp(torch.round(w / scale[..., None]) + zero[..., None],
                        0, maxq)
    codes = codes.reshape(n_out, groups * group)[:, :k_in]
    return (codes.to(torch.int64), scale16,
            zero.to(torch.int64))


def _pack_int32(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack non-negative ``bits``-bit ``values`` (2-D) along ``dim``:
    output element i along ``dim`` holds inputs ``i * (32 / bits) + j`` at
    bit offset ``bits * j``."""
    per_word = 32 // bits
    v = values.to(torch.int64)
    if dim == 0:
        v = v.reshape(v.shape[0] // per_word, per_word, v.shape[1])
        shifts = (torch.arange(per_word) * bits).reshape(1, per_word, 1)
        words = (v << shifts).sum(dim=1)
    else:
        v = v.reshape(v.shape[0], v.shape[1] // per_word, per_word)
        shifts = (torch.arange(per_word) * bits).reshape(1, 1, per_word)
        words = (v << shifts).sum(dim=2)
    # Reinterpret the unsigned 32-bit words as int32 (two's complement).
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def _gptq_quantize(src: Path, out: Path, bits: int, group_size: int,
                   sym: bool, lm_head: bool) -> None:
    config = _read_config(src)
    skeleton = _skeleton(_plain_config(src))
    tensors = _load_tensors(src)
    head = _output_head_name(skeleton)
    embed = _input_embedding_name(skeleton)
    tied = f"{head}.weight" not in tensors
    if tied and lm_head:
        # Untie: the head becomes a tensor of its own (quantized below).
        tensors[f"{head}.weight"] = tensors[f"{embed}.weight"]
        config["tie_word_embeddings"] = False
    targets = set(_decoder_linears(skeleton)) | ({head} if lm_head else set())
    per_word = 32 // bits

    result: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if prefix in targets and leaf == "bias":
            result[name] = tensor.to(torch.float16)
            continue
        if prefix not in targets or leaf != "weight":
            result[name] = (tensor.to(torch.float16)
                            if tensor.is_floating_point() else tensor)
            continue
        n_out, k_in = tensor.shape
        if k_in % per_word or n_out % per_word:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} does not "
                             f"pack {per_word} codes per int32")
        codes, scale16, zero = _gptq_rtn(tensor, bits, group_size, sym)
        group = k_in if group_size == -1 else group_size
        result[f"{prefix}.qweight"] = _pack_int32(codes.t(), bits, dim=0)
        result[f"{prefix}.qzeros"] = _pack_int32(zero.t() - 1, bits, dim=1)
        result[f"{prefix}.scales"] = scale16.t().contiguous()
        result[f"{prefix}.g_idx"] = (torch.arange(k_in) // group).to(
            torch.int32)

    quant_config = {
        "bits": bits, "group_size": group_size, "damp_percent": 0.01,
        "desc_act": False, "static_groups": False, "sym": sym,
        "true_sequential": True, "lm_head": lm_head, "quant_method": "gptq",
        "checkpoint_format": "gptq"
    }
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"
    config["quantization_config"] = quant_config

    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in result.items()},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "quantize_config.json").write_text(
        json.dumps(quant_config, indent=2) + "\n")


# ------------------------------------------------- compressed-tensors ----

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


def _ct_quantize(src: Path, out: Path, fmt: str, group_size: int | None,
                 sym: bool, lm_head: bool, calibration: str | None) -> None:
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig,
                                                 QuantizationStatus,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not sym:
        raise ValueError(f"{fmt}: only symmetric weights are offered "
                         "(compressed-tensors 0.10.2 cannot decompress "
                         "packed asymmetric zero points)")
    scheme = _ct_scheme(fmt, group_size)
    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto").eval()
    head = _output_head_name(model)
    if lm_head and model.config.tie_word_embeddings:
        out_emb = model.get_output_embeddings()
        out_emb.weight = torch.nn.Parameter(
            model.get_input_embeddings().weight.detach().clone(),
            requires_grad=False)
        model.config.tie_word_embeddings = False
    group = scheme.weights.group_size
    if group is not None and group > 0:
        for name in _decoder_linears(model) + ([head] if lm_head else []):
            k_in = model.get_submodule(name).in_features
            if k_in % group:
                raise ValueError(f"{name}: input size {k_in} is not a "
                                 f"multiple of group size {group}")

    config = QuantizationConfig(config_groups={"group_0": scheme},
                                ignore=[] if lm_head else [head])
    apply_quantization_config(model, config)
    quantized = {n: m for n, m in model.named_modules()
                 if getattr(m, "quantization_scheme", None) is not None}

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
                                  static, _calibration_text(calibration))
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


# ----------------------------------------------------------- public API --

def quantize(src: Path, out: Path, fmt: str, group_size: int | None = None,
             sym: bool = True, lm_head: bool = False,
             calibration: str | None = None) -> Path:
    """Write the ``fmt`` checkpoint of the float folder ``src`` to ``out``
    (with its tokenizer and generation config files); returns ``out``.

    ``group_size``: GPTQ and W4A16 default to 128, W8A16 to per channel
    (-1); ``sym=False``: asymmetric (GPTQ only); ``lm_head``: quantize the
    output head too (untied first if tied); ``calibration``: the FP8
    calibration text, a file or the text itself."""
    src, out = Path(src), Path(out)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
    if fmt in GPTQ_BITS:
        gs = 128 if group_size is None else group_size
        if gs != -1 and gs <= 0:
            raise ValueError(f"bad group size {gs}")
        _gptq_quantize(src, out, GPTQ_BITS[fmt], gs, sym, lm_head)
    else:
        _ct_quantize(src, out, fmt, group_size, sym, lm_head, calibration)
    _copy_side_files(src, out)
    return out


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
    tensors = _load_tensors(folder)
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
        elif not name.endswith(_AUX_SUFFIXES):
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
    return apply_quantization_config(_skeleton(_plain_config(folder)), qc)


def _ct_dequantized(folder: Path):
    from compressed_tensors.compressors import ModelCompressor
    compressor = ModelCompressor.from_pretrained(str(folder))
    names_to_scheme = _ct_names_to_scheme(folder,
                                          compressor.quantization_config)
    result: dict[str, torch.Tensor] = {}
    for module, data in compressor.quantization_compressor.decompress(
            str(folder), names_to_scheme=names_to_scheme):
        result[f"{module}.weight"] = data["weight"].to(torch.float32)
    for name, tensor in _load_tensors(folder).items():
        if name in result or name.endswith(_AUX_SUFFIXES):
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
    config = _read_config(folder)
    method = config.get("quantization_config", {}).get("quant_method")
    if method == "gptq":
        return _gptq_dequantized(folder, config)
    if method == "compressed-tensors":
        return _ct_dequantized(folder)
    raise ValueError(f"{folder}: not a quantized checkpoint of this script "
                     f"(quant_method {method!r})")


def activation_quant(folder: Path) -> dict:
    """Per quantized linear (HF module name), how its input is quantized:
    ``("static", scale)`` (a float32 tensor of shape [1]) or
    ``("dynamic", None)``; ``{}`` for weight-only checkpoints."""
    folder = Path(folder)
    qc = _read_config(folder).get("quantization_config", {})
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
                tensors = _load_tensors(folder)
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
    config = _plain_config(folder)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dequantized_state_dict(folder)
    if config.tie_word_embeddings:
        # The head is the token embedding; a head tensor the file holds
        # anyway is ignored, as transformers and vLLM ignore it.
        state.pop(f"{_output_head_name(model)}.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
        head = f"{_output_head_name(model)}.weight"
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, type=Path,
                        help="float Hugging Face folder")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--group-size", type=int, default=None,
                        help="weight group size, -1 per channel (default: "
                        "128 for GPTQ and w4a16, per channel for w8a16)")
    parser.add_argument("--asym", action="store_true",
                        help="asymmetric weights (GPTQ formats only)")
    parser.add_argument("--lm-head", action="store_true",
                        help="quantize the output head too")
    parser.add_argument("--calibration", default=None,
                        help="text file calibrating the fp8 input scales")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = quantize(args.model, args.out, args.format,
                   group_size=args.group_size, sym=not args.asym,
                   lm_head=args.lm_head, calibration=args.calibration)
    print(f"wrote {args.format} checkpoint to {out} in "
          f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
