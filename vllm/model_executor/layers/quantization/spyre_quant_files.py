"""Reading a float or quantized Hugging Face checkpoint folder tensor by
tensor: its config, its safetensors, the model skeleton on the meta
device, and the names of its linear layers.  Shared by the quantized
checkpoint writers (``spyre_quant_writer``, ``spyre_quant_writer_ct``) and
the tests' dequantized reference; never imported when serving."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

#: Tensor-name suffixes of quantization parameters (not float weights).
AUX_SUFFIXES = (".qweight", ".qzeros", ".scales", ".g_idx",
                ".weight_packed", ".weight_scale", ".weight_zero_point",
                ".weight_shape", ".weight_g_idx", ".weight_global_scale",
                ".input_scale", ".input_zero_point",
                ".input_global_scale", ".output_scale",
                ".output_zero_point")

_DECODER_LAYER = re.compile(r"(^|\.)layers\.\d+\.")


def read_config(folder: Path) -> dict:
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


def load_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {folder}")
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            where.update(dict.fromkeys(st.keys(), f))
    return _LazyTensors(where)


def plain_config(folder: Path):
    """The folder's transformers config without its quantization config."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    return config


def skeleton(config):
    """The model of ``config`` on the meta device (no memory, no init)."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def output_head_name(model) -> str:
    head = model.get_output_embeddings()
    return next(n for n, m in model.named_modules() if m is head)


def input_embedding_name(model) -> str:
    emb = model.get_input_embeddings()
    return next(n for n, m in model.named_modules() if m is emb)


def decoder_linears(model) -> list[str]:
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and _DECODER_LAYER.search(n)]
