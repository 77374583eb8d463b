"""Attention of one encoder pass, all layers: the C++ kernel against SDPA.

Packs texts as the pooling runner does (rows of the text length rounded up
to 64 slots, as many texts to a row as fit), takes the encoder's layer
count, heads and head size from the model's ``config.json``, and times one
pass of attention over every layer (random float32 projections, strided
views of one fused projection as FMS hands them over):

* ``SDPA fp32`` / ``SDPA bf16``: PyTorch's SDPA with the block-diagonal
  mask, in float32 and in bfloat16 (what ``eager`` runs);
* ``kernel fp32`` / ``kernel bf16``: ``spyre_kernels::encoder_attention``
  with ``text_starts``, float32 products and bfloat16 products (what
  ``inductor`` runs).

Reports the best of N passes, SDPA fp32 / each, and the largest difference
of each from SDPA fp32 (the float32 kernel must agree to rounding).

    python benchmarks/encoder_attention.py [--model DIR]
        [--cases 32x32,32x256,8x256] [--repeats 5] [--json PATH]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from spyre_support.bench import (add_json_option, benchmark_parser, cores,
                                 machine_info, native_kernels_available, table,
                                 write_json)
from spyre_support.paths import REPO

from attention import best_pass

DEFAULT_EMBEDDER = str(REPO / "models" / "all-MiniLM-L6-v2")
ENGINES = ("SDPA fp32", "SDPA bf16", "kernel fp32", "kernel bf16")


def parse_cases(text: str) -> list[tuple[int, int]]:
    """``TEXTSxTOKENS,...`` -> [(texts, tokens), ...]."""
    out = []
    for item in text.split(","):
        texts, tokens = item.lower().split("x")
        out.append((int(texts), int(tokens)))
    return out


def packed(texts: int, tokens: int):
    """The [B, L] packing of ``texts`` texts of ``tokens`` tokens."""
    from vllm.config.spyre import WarmupShape
    from vllm.core.spyre_pooling_shapes import first_fit
    from vllm.worker.spyre_pooling_inputs import packed_inputs
    row = -(-tokens // 64) * 64
    per_row = row // tokens
    shape = WarmupShape(row, 0, -(-texts // per_row))
    placements = first_fit([tokens] * texts, shape)
    return packed_inputs([[1] * tokens] * texts, [None] * texts, shape,
                         placements, pad_id=0)


def main() -> int:
    ap = benchmark_parser(__doc__, model=DEFAULT_EMBEDDER)
    ap.add_argument("--cases", type=parse_cases,
                    default=parse_cases("32x32,32x256,8x256"))
    ap.add_argument("--repeats", type=int, default=5)
    add_json_option(ap, "encoder_attention.json")
    args = ap.parse_args()

    import torch
    import torch.nn.functional as F
    if not native_kernels_available():
        return 1
    torch.set_num_threads(cores())
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    layers, heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    dim = cfg["hidden_size"] // heads
    gen = torch.Generator().manual_seed(0)
    results, mismatches = [], 0
    for texts, tokens in args.cases:
        inputs = packed(texts, tokens)
        B, L = inputs.input_ids.shape
        projections = []
        for _ in range(layers):
            fused = torch.randn(B, L, 3 * heads * dim, generator=gen)
            projections.append([t.view(B, L, heads, dim)
                                for t in fused.split(heads * dim, dim=-1)])
        mask = inputs.mask.unsqueeze(1)

        def sdpa(dtype):
            def attend(qkv):
                out = F.scaled_dot_product_attention(
                    *(t.transpose(1, 2).to(dtype) for t in qkv),
                    attn_mask=mask, scale=dim**-0.5)
                return out.transpose(1, 2).contiguous().float()
            return attend

        def kernel(bf16):
            def attend(qkv):
                return torch.ops.spyre_kernels.encoder_attention(
                    *qkv, inputs.text_starts, dim**-0.5, bf16)
            return attend

        calls = dict(zip(ENGINES, (sdpa(torch.float32), sdpa(torch.bfloat16),
                                   kernel(False), kernel(True))))
        seconds, diffs = {}, {}
        with torch.no_grad():
            outs = {}
            for name, attend in calls.items():
                seconds[name], outs[name] = best_pass(projections, attend,
                                                      args.repeats)
            for name in ENGINES[1:]:
                diffs[name] = max((a - r).abs().max().item() for a, r in zip(
                    outs[name], outs["SDPA fp32"]))
        same = all(
            torch.allclose(a, r, atol=1e-5, rtol=1e-5)
            for a, r in zip(outs["kernel fp32"], outs["SDPA fp32"]))
        mismatches += not same
        results.append(dict(texts=texts, tokens=tokens, batch=B, slots=L,
                            seconds=seconds, max_diff=diffs, same=same))
        print(f"{texts} x {tokens} tokens ({B} x {L}): " + ", ".join(
            f"{n} {s * 1e3:.1f} ms" for n, s in seconds.items()), flush=True)

    write_json(args.json, dict(args=dict(vars(args), cases=args.cases),
                               machine=machine_info(), layers=layers,
                               heads=heads, head_dim=dim, results=results))
    print(f"\nmodel {Path(args.model).name}: {layers} layers, {heads} heads "
          f"of {dim}, best of {args.repeats}, {cores()} cores; times are "
          "one pass's attention over every layer (ms)")
    rows = [[f"{r['texts']} x {r['tokens']}", f"{r['batch']} x {r['slots']}"]
            + [f"{r['seconds'][n] * 1e3:.1f}" for n in ENGINES]
            + [f"{r['seconds']['SDPA fp32'] / r['seconds'][n]:.2f}x"
               for n in ENGINES[1:]]
            + [f"{r['max_diff']['kernel bf16']:.1e}",
               f"{r['max_diff']['SDPA bf16']:.1e}",
               "yes" if r["same"] else "NO"] for r in results]
    print(table(["texts x tokens", "B x L", *ENGINES,
                 *(f"fp32 SDPA / {n}" for n in ENGINES[1:]),
                 "kernel bf16 diff", "SDPA bf16 diff", "fp32 same"], rows))
    if mismatches:
        print(f"FAILED: {mismatches} case(s) where the float32 kernel and "
              "SDPA disagree")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
