"""The adapters' products of one decode step, alone: the LoRA kernel
against the bytes it reads and against the same products in torch ops.

Builds, from the model's config.json, the stacked adapter tensors vLLM's
LoRA layers hold for every projection of every layer (q, k, v, o, gate,
up, down; ``--slots`` slots of rank ``--rank``, random, float32), each
slot's B laid out as the engine lays it (``spyre_punica.tile_b_``), and
times one step's calls (one per fused projection: qkv, o, gate-up, down)
on ``--rows`` rows, with the rows on one adapter and on ``--slots``
different ones (round robin):

* ``kernel``: ``spyre_kernels::lora_add_``, as the engine calls it;
* ``torch-ops``: ``spyre_punica._add_masked`` per slice, what the engine
  runs without the C++ kernels (every slot's product, masked).

Reports the median of the passes in ms, the bytes of the adapters' matrices
a step reads (the slots its rows use) and their rate, the machine's read
bandwidth (as in roofline.py) for reference, and the kernel's time over
the torch ops'.  The two outputs are compared before timing.

    python benchmarks/lora_kernel.py [--model DIR] [--rows 8] [--rank 16]
        [--slots 4] [--passes 50] [--json PATH]
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from spyre_support.bench import (DEFAULT_MODEL, add_json_option,
                                 benchmark_parser, cores, machine_info, table,
                                 write_json)
from roofline import read_bandwidth


def layer_shapes(model: str) -> list[tuple[int, list[int]]]:
    """(inputs, [outputs of each slice]) of a layer's fused projections."""
    config = json.loads((Path(model) / "config.json").read_text())
    hidden = config["hidden_size"]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    inter = config["intermediate_size"]
    return [(hidden, [heads * head_dim, kv, kv]), (heads * head_dim, [hidden]),
            (hidden, [inter, inter]), (inter, [hidden])]


def build(model: str, slots: int, rank: int):
    """Every layer's stacked (A, B) pairs, B tiled, and the layer count."""
    import torch

    from vllm.lora.punica_wrapper.spyre_punica import tile_b_
    config = json.loads((Path(model) / "config.json").read_text())
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(config["num_hidden_layers"]):
        calls = []
        for inputs, outputs in layer_shapes(model):
            pairs = []
            for out in outputs:
                a = torch.randn(slots, 1, rank, inputs, generator=gen) / 64
                b = torch.randn(slots, 1, out, rank, generator=gen) / 64
                tiled = b.clone()
                for slot in range(slots):
                    tile_b_(tiled, slot)
                pairs.append((a, b, tiled))
            calls.append((inputs, pairs))
        layers.append(calls)
    return layers


def step_fns(layers, rows: int, slot_of_row):
    """(kernel step, torch-ops step), each adding into fresh outputs, and
    the outputs of one call of each."""
    import torch

    from vllm.lora.punica_wrapper.spyre_punica import _add_masked
    slots = torch.tensor(slot_of_row, dtype=torch.long)
    gen = torch.Generator().manual_seed(1)
    xs = {inputs: torch.randn(rows, inputs, generator=gen)
          for calls in layers for inputs, _ in calls}
    outs = [[torch.zeros(rows, sum(b.shape[-2] for _, b, _ in pairs))
             for _, pairs in calls] for calls in layers]
    op = torch.ops.spyre_kernels.lora_add_

    def kernel():
        for calls, layer_outs in zip(layers, outs):
            for (inputs, pairs), y in zip(calls, layer_outs):
                args: list = []
                for a, _, tiled in pairs:
                    args += [a, tiled]
                widths = [b.shape[-2] for _, b, _ in pairs]
                op(y, xs[inputs], *args, *[None] * (6 - len(args)), slots,
                   2.0, *widths, *[0] * (3 - len(widths)))

    def torch_ops():
        for calls, layer_outs in zip(layers, outs):
            for (inputs, pairs), y in zip(calls, layer_outs):
                offset = 0
                for a, b, _ in pairs:
                    width = b.shape[-2]
                    _add_masked(y[:, offset:offset + width], xs[inputs], a,
                                b, slots, 2.0)
                    offset += width

    def first_output(fn):
        for layer_outs in outs:
            for y in layer_outs:
                y.zero_()
        fn()
        return outs[0][0].clone()

    return kernel, torch_ops, first_output


def median_ms(fn, passes: int) -> float:
    fn()
    times = []
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> int:
    ap = benchmark_parser(__doc__, model=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--passes", type=int, default=50)
    add_json_option(ap, "lora_kernel.json")
    args = ap.parse_args()
    import torch

    from vllm.spyre_kernels import ops as native
    if not native.available():
        print("the C++ kernels could not be built", file=sys.stderr)
        return 1
    torch.set_num_threads(cores())
    layers = build(args.model, args.slots, args.rank)
    per_slot = sum(a[0].numel() + b[0].numel()
                   for calls in layers for _, pairs in calls
                   for a, b, _ in pairs) * 4
    bandwidth = read_bandwidth(1.0)
    rows, result = [], dict(args=vars(args), machine=machine_info(),
                            read_bandwidth_gb_s=bandwidth / 1e9, runs={})
    for used in sorted({1, min(args.slots, args.rows)}):
        kernel, torch_ops, first_output = step_fns(
            layers, args.rows, [r % used for r in range(args.rows)])
        torch.testing.assert_close(first_output(kernel),
                                   first_output(torch_ops),
                                   rtol=1e-4, atol=1e-5)
        ms = {name: median_ms(fn, args.passes)
              for name, fn in (("kernel", kernel), ("torch-ops", torch_ops))}
        read = used * per_slot
        result["runs"][used] = dict(ms, bytes=read)
        for name, t in ms.items():
            rows.append([name, used, f"{t:.2f}", f"{read / 2**20:.1f}",
                         f"{read / t / 1e6:.1f}",
                         f"{t / ms['torch-ops']:.2f}x"])
    write_json(args.json, result)
    print(f"\nthe adapters' products of one decode step of {args.model} "
          f"({len(layers)} layers), {args.rows} rows, rank {args.rank}, "
          f"float32, {cores()} cores; machine read bandwidth "
          f"{bandwidth / 1e9:.1f} GB/s")
    print(table(["path", "adapters", "ms/step", "MiB read", "GB/s",
                 "/ torch-ops"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
