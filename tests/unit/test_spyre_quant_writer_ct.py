"""The compressed-tensors writer's formats without calibrated inputs
(``fp8-dynamic``, ``w8a16``, ``w4a16``) are written a tensor at a time
(``spyre_quant_writer_ct.write_streamed``), never holding the float model,
so that 8B checkpoints can be written on a 24 GiB machine: every tensor and
the quantization config equal what compressed-tensors' whole-model
compressor writes for the same model."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm.model_executor.layers.quantization import spyre_quant_writer_ct

FORMATS = ("fp8-dynamic", "w8a16", "w4a16")


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    from spyre_support.tiny_models import build_bf16_valued_llama
    from spyre_support.tiny_quantized import build_tiny_quant_base
    root = tmp_path_factory.mktemp("ct-bases")
    return {
        "float32": build_tiny_quant_base(root / "float32"),
        "bf16-tied": build_bf16_valued_llama(root / "bf16", torch.bfloat16,
                                             hidden=128, intermediate=256,
                                             tied=True),
    }


def _read(folder: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors, json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("base,lm_head", [("float32", False),
                                          ("bf16-tied", False),
                                          ("bf16-tied", True)])
def test_streamed_equals_whole_model(bases, tmp_path, fmt, base, lm_head):
    src = bases[base]
    streamed, whole = tmp_path / "streamed", tmp_path / "whole"
    spyre_quant_writer_ct.write_streamed(
        src, streamed, fmt, spyre_quant_writer_ct._ct_scheme(fmt, None),
        lm_head)
    spyre_quant_writer_ct._write_calibrated(
        src, whole, fmt, spyre_quant_writer_ct._ct_scheme(fmt, None),
        lm_head, None)
    got, got_config = _read(streamed)
    want, want_config = _read(whole)
    assert got.keys() == want.keys()
    assert [k for k in got if k.endswith(("weight_packed", "weight_scale"))]
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    assert got_config["quantization_config"] == \
        want_config["quantization_config"]
    assert got_config.get("tie_word_embeddings", True) == \
        want_config.get("tie_word_embeddings", True)


def test_write_takes_the_streamed_path_unless_inputs_are_calibrated(
        bases, tmp_path, monkeypatch):
    taken = []
    monkeypatch.setattr(spyre_quant_writer_ct, "write_streamed",
                        lambda *a: taken.append("streamed"))
    monkeypatch.setattr(spyre_quant_writer_ct, "_write_calibrated",
                        lambda *a: taken.append("whole"))
    for fmt in ("fp8", "fp8-dynamic", "w8a16", "w4a16"):
        spyre_quant_writer_ct.write(bases["float32"], tmp_path / fmt, fmt,
                                    None, True, False, None)
    assert taken == ["whole", "streamed", "streamed", "streamed"]
