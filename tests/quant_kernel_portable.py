"""Builds the quantized kernel without AVX-512 (``-march=x86-64-v3``: the
GCC vector-extension code Power, Z and AVX2-only x86 machines run) in
this process and checks it against the dequantized product; prints OK.
Run by tests/unit/test_spyre_quant.py in a subprocess, so that its op
does not meet the one the project's extension registers.

Given a path, it also saves there the products of ``integer_cases`` on
AVX2's integer tiles (``quant_int16.h``), which the test compares with
the project's own build bit for bit; ``--avx-vnni`` before the path
builds the AVX-VNNI form of those tiles (for a CPU that has it)."""
import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / "vllm" / "spyre_kernels" / "quant.cpp"


def integer_cases(mod):
    """``{name: (weight, inputs)}``: int8 and int4 layers at decode
    heights (1-3 rows), groups of 128 with a shorter last one, per-channel
    scales, groups of 64; offsets, a zero point or neither.  ``mod`` is the
    layer module (``spyre_quant_linear``)."""
    cases = {}
    for kind in ("int8", "int4"):
        for n, k, group in ((70, 576, 128), (64, 2048, 2048), (33, 512, 64)):
            g = torch.Generator().manual_seed(n + k)
            groups = -(-k // group)
            low, high = (-128, 128) if kind == "int8" else (0, 16)
            codes = torch.randint(low, high, (n, k), generator=g,
                                  dtype=torch.int8)
            scales = torch.rand(n, groups, generator=g) * 0.01 + 0.001
            zeros = {"none": None,
                     "offsets": torch.randint(-4, 5, (n, groups),
                                              generator=g).float(),
                     "uniform": torch.full((n, groups), 3.0)}
            for name, z in zeros.items():
                w = mod.QuantWeight(kind, codes, scales, z, group)
                for rows in (1, 2, 3):
                    # Inputs over four orders of magnitude: some rounded.
                    x = torch.randn(rows, k, generator=g) * torch.pow(
                        10.0, -4 * torch.rand(rows, k, generator=g))
                    cases[f"{kind}-{n}x{k}-g{group}-{name}-{rows}"] = (w, x)
    return cases


def main() -> int:
    # `--avx-vnni` first: the same target with AVX-VNNI (256-bit
    # vpdpwssd), which the integer tiles use where the build has it.
    vnni = sys.argv[1:2] == ["--avx-vnni"]
    if vnni:
        del sys.argv[1]
    load(name="spyre_quant_portable" + ("_vnni" if vnni else ""),
         sources=[str(SOURCE)],
         extra_cflags=["-O2", "-march=x86-64-v3", "-fopenmp"] +
         (["-mavxvnni"] if vnni else []),
         extra_ldflags=["-fopenmp"], is_python_module=False)
    # The layer module only packs and calls the op: importable from the
    # working tree like any other file.
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "quant_linear_module",
        REPO / "vllm" / "model_executor" / "layers" / "quantization"
        / "spyre_quant_linear.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    codes = codes.view(-1, 1).repeat(1, 32)
    w = mod.QuantWeight("fp8", codes, torch.ones(codes.shape[0], 1))
    got = mod.quant_linear(torch.eye(32)[:1], mod.pack(w), None)[0]
    assert torch.equal(got, codes[:, 0].float()), "fp8 codes"
    for kind in ("int8", "int4", "fp8"):
        if kind == "int8":
            q = torch.randint(-128, 128, (40, 256), generator=g,
                              dtype=torch.int8)
        elif kind == "int4":
            q = torch.randint(0, 16, (40, 256), generator=g,
                              dtype=torch.int8)
        else:
            q = (torch.randn(40, 256, generator=g) * 30).to(
                torch.float8_e4m3fn)
        scales = torch.rand(40, 2, generator=g) + 0.1
        # Zero points per row and group (offsets), and one for the layer.
        for zeros in (torch.rand(40, 2, generator=g) * 4,
                      torch.full((40, 2), 8.0)):
            w = mod.QuantWeight(kind, q, scales, zeros, None)
            for rows in (1, 5, 13):
                x = torch.randn(rows, 256, generator=g)
                for rnd in (False, True):
                    xr = x.bfloat16().float() if rnd else x
                    want = xr.double() @ w.dequantize().double().T
                    y = mod.quant_linear(x, mod.pack(w), None, rnd).double()
                    err = ((y - want).abs().max() / want.abs().max()).item()
                    assert err < 2e-5, (kind, rows, rnd, err)
    if len(sys.argv) > 1:
        products = {}
        for name, (w, x) in integer_cases(mod).items():
            packed = mod.pack(w)
            got = mod.quant_linear(x, packed, None, True, ints=3)
            # The integer tiles ran: the float32 tiles' product differs.
            assert not torch.equal(
                got, mod.quant_linear(x, packed, None, True, ints=0)), name
            products[name] = got
        torch.save(products, sys.argv[1])
    print("OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
