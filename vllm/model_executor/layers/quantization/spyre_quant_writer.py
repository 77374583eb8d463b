"""The quantized-checkpoint writer: quantized Hugging Face checkpoints of a
float Llama-family folder, written by each format's specification.

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
    ``absmax(input) / 448``.  The text is ``calibration`` (a
    file, or the text itself), else a built-in paragraph
    (``scripts/quantize.py`` passes ``benchmarks/data/text.txt``).  The output
    head is ignored (``"ignore": ["lm_head"]``) unless ``lm_head``.  Other
    tensors keep the source's dtype.  ``group_size`` may override the int
    formats' grouping (-1: per channel); only symmetric weights are
    offered, compressed-tensors 0.10.2 cannot decompress packed
    asymmetric zero points.

A tied output head (SmolLM2's) that is to be quantized is untied first: the
checkpoint then holds a float embedding and a quantized head, and says
``tie_word_embeddings: false``.

The float model a checkpoint stands for (the tests' reference) is
``spyre_support.quantized_reference``'s.  The compressed-tensors writer is
``spyre_quant_writer_ct``; the checkpoint reading both share is
``spyre_quant_files``; ``scripts/quantize.py`` is this module's command
line.

Usage:
  python scripts/quantize.py --model models/SmolLM2-135M-Instruct \\
      --format gptq-int4 --out /tmp/smollm2-gptq-int4 \\
      [--group-size N] [--asym] [--lm-head] [--calibration FILE]
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from vllm.logger import init_logger
from vllm.model_executor.layers.quantization.spyre_quant_files import (
    decoder_linears, input_embedding_name, load_tensors, output_head_name,
    plain_config, read_config, skeleton)

logger = init_logger(__name__)

FORMATS = ("gptq-int4", "gptq-int8", "fp8", "fp8-dynamic", "w8a16", "w4a16")

#: GPTQ format -> bits.
GPTQ_BITS = {"gptq-int4": 4, "gptq-int8": 8}

#: Files copied verbatim from the source folder when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "generation_config.json")


def _copy_side_files(src: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)


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
    config = read_config(src)
    meta = skeleton(plain_config(src))
    tensors = load_tensors(src)
    head = output_head_name(meta)
    embed = input_embedding_name(meta)
    tied = f"{head}.weight" not in tensors
    if tied and lm_head:
        # Untie: the head becomes a tensor of its own (quantized below).
        tensors[f"{head}.weight"] = tensors[f"{embed}.weight"]
        config["tie_word_embeddings"] = False
    targets = set(decoder_linears(meta)) | ({head} if lm_head else set())
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
        from vllm.model_executor.layers.quantization import (
            spyre_quant_writer_ct)
        spyre_quant_writer_ct.write(src, out, fmt, group_size, sym, lm_head,
                                    calibration)
    _copy_side_files(src, out)
    return out


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
                        help="text file calibrating the fp8 input scales "
                        "(default: a built-in paragraph)")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = quantize(args.model, args.out, args.format,
                   group_size=args.group_size, sym=not args.asym,
                   lm_head=args.lm_head, calibration=args.calibration)
    logger.info("Wrote the %s checkpoint to %s in %.1f s", args.format, out,
                time.perf_counter() - start)
    return 0


if __name__ == "__main__":
    sys.exit(main())
