"""Write the realistic-size benchmark checkpoints: random weights at the
shapes IBM ships Granite in, with the default model's tokenizer.

Speed and memory depend on a model's shapes and bytes, not on its values,
so a random-weight checkpoint at Granite 3.3 2B's or 8B's dimensions
measures what serving the real one costs (its text is noise: quality is
measured on the default model).  Each checkpoint is a Hugging Face folder
(``config.json``, safetensors shards of at most ``SHARD_BYTES`` with their
``model.safetensors.index.json``, the tokenizer files); the tensors are
made and written one shard at a time, so writing an 8B checkpoint holds
one shard in memory, not the model.

    python scripts/benchmark_checkpoints.py [--out models/bench]
        [--shapes granite-3.3-2b,granite-3.3-8b,granite-4.0-h-micro]
        [--formats bf16,fp32,gptq-int8,gptq-int4,fp8]

Shapes (``SHAPES``): ``granite-3.3-2b`` and ``granite-3.3-8b``
(``GraniteForCausalLM`` with its four multipliers, tied embeddings) and
``granite-4.0-h-micro`` (``GraniteMoeHybridForCausalLM``: Mamba-2 layers
with attention every tenth layer, no experts).  The vocabulary is the
default model's 49152 tokens.  ``fp32`` is the bf16 folder's tensors
widened to float32 (exactly), shard by shard, into ``<shape>-fp32``: what
a float32 checkpoint costs to load and hold.  The other formats go through
the quantization writer (``scripts/quantize.py``) from the bf16 folder, the
output head quantized too (as llama.cpp's GGUF files quantize theirs), into
``<shape>-<format>`` beside it, where ``benchmarks/offline.py``'s quantized
engines find them (``_engines.quantized_model``).  The GPTQ formats and
the compressed-tensors ones without calibrated inputs (``fp8-dynamic``,
``w8a16``, ``w4a16``) are written a tensor at a time; ``fp8`` calibrates
its static input scales on the whole float model, which an 8B model does
not leave room for on a 24 GiB machine.  A folder already written (its
``config.json`` present) is kept.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "chat_template.jinja")
#: Tensors per safetensors file, at most (transformers' default size).
SHARD_BYTES = 2 * 2**30
VOCAB = 49152

_GRANITE = dict(architectures=["GraniteForCausalLM"],
                model_type="granite",
                hidden_act="silu",
                num_attention_heads=32,
                num_key_value_heads=8,
                num_hidden_layers=40,
                max_position_embeddings=131072,
                rope_theta=10000000.0,
                rms_norm_eps=1e-5,
                attention_bias=False,
                mlp_bias=False,
                tie_word_embeddings=True,
                embedding_multiplier=12.0,
                residual_multiplier=0.22,
                attention_multiplier=0.0078125,
                logits_scaling=8.0)

#: name -> config.json fields beyond the common ones.
SHAPES = {
    "granite-3.3-2b": dict(_GRANITE, hidden_size=2048,
                           intermediate_size=8192, logits_scaling=8.0),
    "granite-3.3-8b": dict(_GRANITE, hidden_size=4096,
                           intermediate_size=12800, logits_scaling=16.0),
    "granite-4.0-h-micro": dict(
        architectures=["GraniteMoeHybridForCausalLM"],
        model_type="granitemoehybrid",
        hidden_act="silu",
        hidden_size=2048,
        intermediate_size=8192,
        shared_intermediate_size=8192,
        num_local_experts=0,
        num_experts_per_tok=0,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=40,
        layer_types=["attention" if i % 10 == 9 else "mamba"
                     for i in range(40)],
        mamba_n_heads=64,
        mamba_d_head=64,
        mamba_d_state=128,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=256,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        position_embedding_type="nope",
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        attention_bias=False,
        tie_word_embeddings=True,
        embedding_multiplier=12.0,
        residual_multiplier=0.22,
        attention_multiplier=0.0078125,
        logits_scaling=8.0),
}

QUANT_FORMATS = ("gptq-int8", "gptq-int4", "fp8", "fp8-dynamic", "w8a16",
                 "w4a16")


def config_of(shape: str) -> dict:
    """The ``config.json`` of a shape, with the default model's
    vocabulary and special tokens."""
    tok = json.loads((TOKENIZER / "config.json").read_text())
    return dict(SHAPES[shape], vocab_size=VOCAB, torch_dtype="bfloat16",
                bos_token_id=tok["bos_token_id"],
                eos_token_id=tok["eos_token_id"],
                pad_token_id=tok["pad_token_id"],
                initializer_range=0.02, use_cache=True)


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor the checkpoint holds and its shape, in transformers'
    names (its model built on the meta device, so nothing is allocated)."""
    import transformers
    hf_config = transformers.AutoConfig.for_model(**{
        k: v for k, v in config.items() if k != "architectures"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def random_tensor(name: str, shape: tuple[int, ...],
                  generator: torch.Generator) -> torch.Tensor:
    """bfloat16 values a trained model's tensors resemble in scale: norms
    near 1, Mamba's decay logs and skips small and positive, weights of
    standard deviation 0.02."""
    if name.endswith("norm.weight") or name.endswith(".D"):
        return torch.ones(shape, dtype=torch.bfloat16)
    if name.endswith("A_log") or name.endswith("dt_bias"):
        return torch.rand(shape, generator=generator).to(torch.bfloat16)
    if name.endswith(".bias"):
        return torch.zeros(shape, dtype=torch.bfloat16)
    t = torch.empty(shape, dtype=torch.float32)
    t.normal_(0.0, 0.02, generator=generator)
    return t.to(torch.bfloat16)


def write_bf16(shape: str, out: Path, seed: int = 0) -> Path:
    """Writes ``out/<shape>-bf16`` one shard at a time; returns it."""
    from safetensors.torch import save_file
    folder = out / f"{shape}-bf16"
    if (folder / "config.json").exists():
        print(f"{folder}: already written")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    config = config_of(shape)
    shapes = tensor_shapes(config)
    shards: list[list[str]] = [[]]
    size = 0
    for name, dims in shapes.items():
        nbytes = 2 * math.prod(dims)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    start = time.perf_counter()
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(n, shapes[n], generator) for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        weight_map.update({n: file for n in names})
        print(f"{folder.name}: {file} ({len(names)} tensors)", flush=True)
    total = sum(2 * math.prod(d) for d in shapes.values())
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map},
        indent=2))
    for name in TOKENIZER_FILES:
        if (TOKENIZER / name).exists():
            shutil.copy(TOKENIZER / name, folder / name)
    # Last: a folder with its config is a finished one.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    params = sum(math.prod(d) for d in shapes.values())
    print(f"{folder}: {params / 1e9:.2f} B parameters, {total / 2**30:.2f} "
          f"GiB, written in {time.perf_counter() - start:.0f} s")
    return folder


def write_fp32(source: Path) -> Path:
    """The bf16 folder ``source`` with every tensor widened to float32, a
    shard at a time, into ``<shape>-fp32`` beside it; returns it."""
    from safetensors.torch import load_file, save_file
    folder = source.with_name(source.name.removesuffix("-bf16") + "-fp32")
    if (folder / "config.json").exists():
        print(f"{folder}: already written")
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    index = json.loads((source / "model.safetensors.index.json").read_text())
    start = time.perf_counter()
    for file in sorted(set(index["weight_map"].values())):
        tensors = {name: t.float() for name, t in
                   load_file(str(source / file)).items()}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        del tensors
        print(f"{folder.name}: {file}", flush=True)
    index["metadata"]["total_size"] *= 2
    (folder / "model.safetensors.index.json").write_text(
        json.dumps(index, indent=2))
    for name in TOKENIZER_FILES:
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = "float32"
    # Last: a folder with its config is a finished one.
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    print(f"{folder}: {index['metadata']['total_size'] / 2**30:.2f} GiB, "
          f"written in {time.perf_counter() - start:.0f} s")
    return folder


def write_quantized(source: Path, fmt: str) -> Path:
    """``scripts/quantize.py``'s ``fmt`` of the bf16 folder ``source``."""
    folder = source.with_name(source.name.removesuffix("-bf16") + f"-{fmt}")
    if (folder / "config.json").exists():
        print(f"{folder}: already written")
        return folder
    subprocess.run([sys.executable, str(ROOT / "scripts" / "quantize.py"),
                    "--model", str(source), "--format", fmt,
                    "--out", str(folder), "--lm-head"], check=True)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "bench")
    ap.add_argument("--shapes", default="granite-3.3-2b",
                    help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--formats", default="bf16",
                    help="comma-separated: bf16, fp32 and any of "
                    f"{', '.join(QUANT_FORMATS)}")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    formats = args.formats.split(",")
    for fmt in formats:
        if fmt not in ("bf16", "fp32") and fmt not in QUANT_FORMATS:
            ap.error(f"--formats: unknown format {fmt!r}")
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            ap.error(f"--shapes: unknown shape {shape!r}; known: "
                     f"{', '.join(SHAPES)}")
        folder = write_bf16(shape, args.out, args.seed)
        for fmt in formats:
            if fmt == "fp32":
                write_fp32(folder)
            elif fmt != "bf16":
                write_quantized(folder, fmt)


if __name__ == "__main__":
    main()
