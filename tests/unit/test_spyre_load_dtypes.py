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


def _checkpoint(out: Path, dtype: torch.dtype, **kwargs) -> Path:
    from spyre_support.tiny_models import build_bf16_valued_llama
    return build_bf16_valued_llama(out, dtype, **kwargs)


def _load(path: Path):
    from transformers import AutoConfig

    from vllm.model_executor.layers.spyre_linear import pack_linears
    from vllm.model_executor.model_loader.spyre_fms_loader import (
        load_fms_decoder)
    model = load_fms_decoder(str(path), AutoConfig.from_pretrained(path),
                             BF16, 1, "eager")
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
        model = load_fms_decoder(path, config, precision, 1, "eager")
        pack_linears(model, precision.linear)
    held = sum(t.nbytes for t in model.state_dict().values())
    print(json.dumps({"growth": status("VmHWM") - before, "held": held}))
""")


def test_peak_growth_of_a_bf16_load_is_the_held_bytes(tmp_path):
    """Peak resident growth of loading a bfloat16 checkpoint of 87 M
    linear weights (174 MB in bfloat16; a float32 copy would add 348 MB)
    stays within the bytes held plus one layer's transient buffers."""
    tiny = _checkpoint(tmp_path / "tiny", torch.bfloat16)
    path = _checkpoint(tmp_path / "bf16", torch.bfloat16, hidden=1024,
                       layers=6, intermediate=4096)
    linear_bytes = 6 * 2 * (2 * 1024 * 1024 + 2 * 1024 * 256 +
                            3 * 1024 * 4096)
    run = subprocess.run([sys.executable, "-c", _PEAK, str(tiny), str(path)],
                         capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["held"] >= linear_bytes
    # A few tensors' transient buffers (as read, packed before the old
    # weight is freed: 8 MiB at most each here).
    assert result["growth"] <= result["held"] + 96 * 2**20, result
