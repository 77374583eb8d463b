"""Loading a checkpoint into the dtypes it is held in
(``spyre_dtypes.load_dtype``, ``model_loader.spyre_fms_loader``): a bfloat16
checkpoint served in bfloat16 on the CPU is read in bfloat16, its linear
weights packed from that, and no float32 copy of a linear layer is ever
made; the model it gives equals, tensor for tensor, the one read through
float32 from a float32 checkpoint of the same values."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm.model_executor.models.spyre_dtypes import (Precision, load_dtype,
                                                     precision_of,
                                                     reads_linears_narrow,
                                                     stored_dtypes)

BF16 = precision_of(torch.bfloat16, "eager")


def test_load_dtype_reads_narrow_only_where_nothing_is_rounded():
    assert BF16 == Precision(torch.float32, torch.bfloat16, torch.bfloat16)
    assert load_dtype(BF16, {torch.bfloat16}) == torch.bfloat16
    # Float32 or float16 tensors would be rounded: read at float32.
    for stored in ({torch.float32}, {torch.float16},
                   {torch.bfloat16, torch.float32}, set()):
        assert load_dtype(BF16, stored) == torch.float32
    fp32 = precision_of(torch.float32, "eager")
    assert load_dtype(fp32, {torch.bfloat16}) == torch.float32
    card = precision_of(torch.bfloat16, "sendnn")
    assert load_dtype(card, {torch.bfloat16}) == torch.bfloat16


def test_linears_are_held_narrow_when_read_so_or_converted_as_read():
    bf16, fp32 = {torch.bfloat16}, {torch.float32}
    # Read narrow: any rank, packed or not.
    assert reads_linears_narrow(BF16, bf16, 2, False)
    # Converted as read: only where the kernels pack them, the whole
    # model on this rank.
    assert reads_linears_narrow(BF16, fp32, 1, True)
    assert not reads_linears_narrow(BF16, fp32, 1, False)
    assert not reads_linears_narrow(BF16, fp32, 2, True)
    # Served in float32, or on the card: nothing narrower to hold.
    for precision in (precision_of(torch.float32, "eager"),
                      precision_of(torch.bfloat16, "sendnn")):
        assert not reads_linears_narrow(precision, bf16, 1, True)


def _checkpoint(out: Path, dtype: torch.dtype, **kwargs) -> Path:
    from spyre_support.tiny_models import build_bf16_valued_llama
    return build_bf16_valued_llama(out, dtype, **kwargs)


def _read(path: Path, packed: bool = True):
    from transformers import AutoConfig

    from vllm.model_executor.model_loader.spyre_fms_loader import (
        load_fms_decoder)
    return load_fms_decoder(str(path), AutoConfig.from_pretrained(path),
                            BF16, 1, "eager", packed=packed)


def _load(path: Path, packed: bool = True):
    from vllm.model_executor.layers.spyre_linear import pack_linears
    model = _read(path, packed)
    pack_linears(model, BF16.linear)
    return model


class _Float32Outputs(TorchDispatchMode):
    """Records the shape of every float32 tensor any op makes."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out, )):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.shapes.add(tuple(t.shape))
        return out


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_bf16_checkpoint_is_read_without_float32_linear_copies(
        tmp_path, tied):
    narrow = _checkpoint(tmp_path / "bf16", torch.bfloat16, tied=tied)
    wide = _checkpoint(tmp_path / "fp32", torch.float32, tied=tied)
    assert stored_dtypes(str(narrow)) == {torch.bfloat16}
    with _Float32Outputs() as seen:
        model = _load(narrow)
    # Every linear weight of the checkpoint, FMS's fused or not, and its
    # transpose: none was ever made in float32 (the tied head is the
    # embedding, which is held in float32).
    linear = {tuple(t.shape) for name, t in
              __import__("safetensors.torch").torch.load_file(
                  str(narrow / "model.safetensors")).items()
              if t.dim() == 2 and "embed" not in name and
              name != "lm_head.weight"}
    linear |= {s[::-1] for s in linear}
    assert linear and not (linear & seen.shapes), linear & seen.shapes
    # The same model, tensor for tensor, as the float32 read of the same
    # values gives.
    reference = _load(wide)
    got, want = model.state_dict(), reference.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name
    packed = [n for n in got if n.endswith(".packed")]
    assert packed and all(got[n].dtype == torch.bfloat16 for n in packed)
    assert all(got[n].dtype == torch.float32 for n in got
               if "packed" not in n and got[n].is_floating_point())


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp32_checkpoint_in_bf16_is_read_into_bf16_linear_weights(
        tmp_path, tied):
    """A float32 checkpoint served in bfloat16: each weight the kernels
    pack is bfloat16 from the read on (the tied head, which is the
    embedding, stays float32), and the packed model is, byte for byte,
    the one the float32 read followed by packing gave."""
    from spyre_support.tiny_models import build_tiny_llama

    from vllm.model_executor.layers.spyre_linear import plain_linear_types
    path = build_tiny_llama(tmp_path / "fp32", tied=tied)
    assert stored_dtypes(str(path)) == {torch.float32}
    read = _read(path)
    plain = plain_linear_types()
    linears = {name: m.weight for name, m in read.named_modules()
               if type(m) in plain}
    embedding = {id(t) for name, t in read.named_parameters(
        remove_duplicate=False) if "embedding" in name}
    assert linears
    for name, weight in linears.items():
        tied_head = id(weight) in embedding
        assert weight.dtype == (torch.float32 if tied_head else
                                torch.bfloat16), name
    assert tied == any(id(w) in embedding for w in linears.values())
    assert all(t.dtype == torch.float32 for n, t in read.named_parameters()
               if n.rpartition(".")[0] not in linears)
    got = _load(path).state_dict()
    want = _load(path, packed=False).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert got[name].dtype == want[name].dtype, name
        assert torch.equal(got[name], want[name]), name


_PEAK = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoConfig
    from vllm.model_executor.layers.spyre_linear import pack_linears
    from vllm.model_executor.model_loader.spyre_fms_loader import (
        load_fms_decoder)
    from vllm.model_executor.models.spyre_dtypes import precision_of
    from vllm.worker.spyre_heap import return_large_buffers

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    precision = precision_of(torch.bfloat16, "eager")
    return_large_buffers(True)  # as the worker does for its load
    # The first load (a tiny model) pays for what loading imports and
    # sets up once; the second is measured.
    for path in sys.argv[1:]:
        config = AutoConfig.from_pretrained(path)
        before = status("VmRSS")
        model = load_fms_decoder(path, config, precision, 1, "eager",
                                 packed=True)
        pack_linears(model, precision.linear)
    held = sum(t.nbytes for t in model.state_dict().values())
    print(json.dumps({"growth": status("VmHWM") - before, "held": held}))
""")


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float32],
                         ids=["bf16", "fp32"])
def test_peak_growth_of_a_bf16_load_is_the_held_bytes(tmp_path, stored):
    """Peak resident growth of loading a checkpoint of 87 M linear
    weights in bfloat16 (174 MB; a float32 copy would add 348 MB), stored
    in bfloat16 or in float32, stays within the bytes held plus one
    layer's transient buffers."""
    tiny = _checkpoint(tmp_path / "tiny", stored)
    path = _checkpoint(tmp_path / "big", stored, hidden=1024,
                       layers=6, intermediate=4096)
    linear_bytes = 6 * 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 +
                            3 * 1024 * 4096)
    run = subprocess.run([sys.executable, "-c", _PEAK, str(tiny), str(path)],
                         capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["held"] >= linear_bytes
    # A few tensors' transient buffers (as read, packed before the old
    # weight is freed: 8 MiB at most each here in bfloat16; a float32
    # read's are twice as wide, its fused gate projections 32 MiB a
    # layer).  Read whole in float32, then packed, it grew by 444 MB.
    slack = 96 if stored == torch.bfloat16 else 128
    assert result["growth"] <= result["held"] + slack * 2**20, result


def test_fused_weights_are_the_adapters_own_tensors(tmp_path, monkeypatch):
    """FMS's adapter concatenates the query/key/value and the gate
    projections into new tensors: those become the model's parameters
    (``spyre_fms_loader._adopting_fresh_tensors``) and never reach FMS's
    copy into a fresh parameter; tensors read from the mapped file do."""
    from fms.utils import serialization
    copied: list[str] = []
    original = serialization._load_partial_state_dict

    def recording(model, state_dict, needs_tp_sharding, dtype=None):
        copied.extend(state_dict)
        return original(model, state_dict, needs_tp_sharding, dtype)

    monkeypatch.setattr(serialization, "_load_partial_state_dict",
                        recording)
    _load(_checkpoint(tmp_path / "bf16", torch.bfloat16))
    assert serialization._load_partial_state_dict is recording
    assert copied and not [k for k in copied if "fused" in k], copied
    assert [k for k in copied if k.endswith("ff_sub_layer.w2.weight")]
