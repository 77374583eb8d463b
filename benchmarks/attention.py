"""Attention of one step, all layers, on the C++ kernels against torch ops.

Builds the key/value caches a step of the model would read (the model's
layer count, key/value heads and head size from its ``config.json``;
random values, float32) and times one pass of attention over every layer:

* ``paged decode``: continuous batching's decode step, B sequences of
  ``ctx`` tokens each, one query position each, over a block pool whose
  blocks are handed out in shuffled order (as vLLM's block manager leaves
  them after a while);
* ``paged mixed``: the same with the B lengths drawn from 16 to
  ``2 * ctx - 16`` (``ctx`` on average; fixed seed), as a serving step
  holds them;
* ``paged prefill``: one 64-position prefill chunk ending at token ``ctx``
  (B = 1);
* ``static decode``: static batching's decode step over a cache of ``ctx``
  slots per sequence, all visible.

For each, ``spyre_kernels::paged_attention`` / ``decode_attention`` (what the
``inductor`` path runs) against the same attention in torch ops (what
``eager`` runs: gather the blocks, two matrix products and a softmax).
Reports the best of N passes, the key/value bytes a decode step reads and
the rate it reads them at, the torch/kernel ratio, and whether the two
agree (``torch.testing.assert_close`` defaults for float32).

    python benchmarks/attention.py [--model DIR] [--batch-sizes 8,16]
        [--contexts 128,512] [--repeats 5] [--json PATH]
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from spyre_support.bench import (add_json_option, benchmark_parser, cores,
                                 machine_info, native_kernels_available,
                                 parse_ints, table, write_json)

BLOCK = 64  # continuous batching's block size (CB_BLOCK_SIZE)
CHUNK = 64  # positions of a prefill chunk


@dataclass(frozen=True)
class Geometry:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_dir: str) -> "Geometry":
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = cfg["num_attention_heads"]
        return cls(layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads", heads),
                   head_dim=cfg.get("head_dim",
                                    cfg["hidden_size"] // heads))

    @property
    def group(self) -> int:
        return self.heads // self.kv_heads

    def kv_bytes(self, tokens: int) -> int:
        """Key and value bytes of ``tokens`` tokens over every layer."""
        return 2 * tokens * self.kv_heads * self.head_dim * 4 * self.layers


def paged_case(geo: Geometry, lens: list[int], positions: int, gen):
    """Per layer (query, pools, block table, ctx_lens) for sequences of
    ``lens`` tokens, the last ``positions`` of each being queried; the
    kernel and the torch-ops calls of one layer."""
    import torch

    from vllm.attention.ops import spyre_paged_cache as paged_cache
    batch = len(lens)
    width = -(-max(lens) // BLOCK)
    blocks = batch * width + 1
    layers = []
    for _ in range(geo.layers):
        pools = [torch.randn(blocks * BLOCK, geo.kv_heads, geo.head_dim,
                             generator=gen) for _ in range(2)]
        q = torch.randn(batch, geo.kv_heads, positions * geo.group,
                        geo.head_dim, generator=gen)
        layers.append((q, *pools))
    table_ = torch.randperm(blocks - 1, generator=gen)[:batch * width]
    kw = dict(block_table=table_.view(batch, width),
              ctx_lens=torch.stack([torch.arange(n - positions + 1, n + 1)
                                    for n in lens]))
    scale = geo.head_dim**-0.5

    def kernel(layer):
        return paged_cache._attend_kernel(*layer, scale, kw)

    def torch_ops(layer):
        return paged_cache._attend_gather(*layer, scale, kw)

    return layers, kernel, torch_ops


def static_case(geo: Geometry, batch: int, ctx: int, gen):
    import torch

    from vllm.attention.ops import spyre_static_cache as static_cache
    from vllm.attention.ops.spyre_torch_ops import attend_matmul
    layers = []
    for _ in range(geo.layers):
        k, v = (torch.randn(batch, geo.kv_heads, ctx, geo.head_dim,
                            generator=gen) for _ in range(2))
        q = torch.randn(batch, geo.kv_heads, geo.group, geo.head_dim,
                        generator=gen)
        layers.append((q, k, v))
    mask = torch.ones(batch, 1, ctx, dtype=torch.bool)
    scale = geo.head_dim**-0.5

    def kernel(layer):
        return static_cache._attend_kernel(*layer, mask, scale)

    def torch_ops(layer):
        return attend_matmul(*layer, mask, scale)

    return layers, kernel, torch_ops


def best_pass(layers, attend, repeats: int):
    """Best time of one pass over every layer, and its outputs."""
    outputs = [attend(layer) for layer in layers]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for layer in layers:
            attend(layer)
        best = min(best, time.perf_counter() - start)
    return best, outputs


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--batch-sizes", type=parse_ints, default=[8, 16])
    ap.add_argument("--contexts", type=parse_ints, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    add_json_option(ap, "attention.json")
    args = ap.parse_args()

    import torch
    if not native_kernels_available():
        return 1
    torch.set_num_threads(cores())
    geo = Geometry.of(args.model)
    gen = torch.Generator().manual_seed(0)
    cases = []
    for ctx in args.contexts:
        for b in args.batch_sizes:
            cases.append(("paged decode", b, ctx,
                          paged_case(geo, [ctx] * b, 1, gen), geo.kv_bytes(
                              b * ctx)))
        for b in args.batch_sizes:
            lens = torch.randint(16, max(2 * ctx - 15, 17), (b,),
                                 generator=gen).tolist()
            cases.append(("paged mixed", b, ctx, paged_case(geo, lens, 1, gen),
                          geo.kv_bytes(sum(lens))))
        cases.append(("paged prefill", 1, ctx,
                      paged_case(geo, [ctx], min(CHUNK, ctx), gen), None))
        b = max(args.batch_sizes)
        cases.append(("static decode", b, ctx, static_case(geo, b, ctx, gen),
                      geo.kv_bytes(b * ctx)))

    results, mismatches = [], 0
    with torch.no_grad():
        for name, b, ctx, (layers, kernel, torch_ops), nbytes in cases:
            k_s, k_out = best_pass(layers, kernel, args.repeats)
            t_s, t_out = best_pass(layers, torch_ops, args.repeats)
            same = True
            for a, r in zip(k_out, t_out):
                try:
                    torch.testing.assert_close(a, r)
                except AssertionError:
                    same = False
            mismatches += not same
            results.append(dict(case=name, batch=b, ctx=ctx,
                                kernel_s=k_s, torch_ops_s=t_s,
                                kv_bytes=nbytes, same=same))
            print(f"{name} B={b} ctx={ctx}: kernel {k_s * 1e3:.2f} ms, "
                  f"torch ops {t_s * 1e3:.2f} ms", flush=True)
            del layers

    rows = [[r["case"], r["batch"], r["ctx"], f"{r['kernel_s'] * 1e3:.2f}",
             f"{r['torch_ops_s'] * 1e3:.2f}",
             f"{r['torch_ops_s'] / r['kernel_s']:.1f}x",
             "-" if r["kv_bytes"] is None else f"{r['kv_bytes'] / 1e6:.0f}",
             "-" if r["kv_bytes"] is None else
             f"{r['kv_bytes'] / r['kernel_s'] / 1e9:.1f}",
             "yes" if r["same"] else "NO"] for r in results]
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               geometry=vars(geo), results=results))
    print(f"\nmodel {Path(args.model).name}: {geo.layers} layers, "
          f"{geo.heads} query / {geo.kv_heads} key-value heads of "
          f"{geo.head_dim}, float32, best of {args.repeats}, {cores()} "
          "cores; times are one step's attention over every layer")
    print(table(["case", "B", "ctx", "kernel ms", "torch ops ms",
                 "torch/kernel", "KV MB read", "kernel GB/s", "same"], rows))
    if mismatches:
        print(f"FAILED: {mismatches} case(s) where the kernel and the torch "
              "ops disagree")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
