"""A decode step's cache writes and attention, every layer, before and after.

Under ``eager`` on the C++ kernels, each op of the graph is dispatched on
its own. A layer's cache step was the two cache ops (the store op, then
the kernel's compute op, each with its views and dtype conversions: 13-17
dispatched ops). Now vLLM's model code (``--model-impl vllm``: quantized
checkpoints, Qwen2, Phi-3) writes the keys and values and attends in one
call (``store_and_attend``), and FMS's model code in two
(``ATTN_NAME_EAGER_KERNEL``: ``store_kernel``, then the compute op on the
query's own layout). This times one step of both over every layer of the
model's geometry
(layer count, heads and head size from its ``config.json``), with
bfloat16 caches under float32 activations as a bfloat16 model holds
them, the query, keys and values strided views of one projection as the
model code splits them:

* ``static decode``: a static batch's decode step, B rows over a cache of
  ``ctx`` slots;
* ``paged decode``: continuous batching's decode step, B sequences of
  ``ctx`` tokens in the block pool;

each through vLLM's model code (``SpyreAttentionImpl.attend``) and
through FMS's registered ops (its keys and values ``[B, 1, kv_heads,
head_dim]`` views, as FMS hands them over).

Reports the best of N passes, the saving per step, and whether before and
after left the same caches and gave the same outputs, bit for bit.

    python benchmarks/cache_step.py [--model DIR] [--batch-sizes 1,4]
        [--contexts 128,512] [--repeats 20] [--json PATH]
"""
from __future__ import annotations

import itertools
import sys
import time

from attention import Geometry

from spyre_support.bench import (add_json_option, benchmark_parser, cores,
                                 machine_info, native_kernels_available,
                                 parse_ints, table, write_json)


def layer_inputs(geo: Geometry, tokens: int, gen):
    """One layer's query, keys and values: views of one projection."""
    import torch
    q, kv = geo.heads * geo.head_dim, geo.kv_heads * geo.head_dim
    return torch.randn(tokens, q + 2 * kv, generator=gen).split([q, kv, kv],
                                                                dim=-1)


def static_case(geo: Geometry, batch: int, ctx: int, gen):
    """(kind, rows, cache kwargs, per layer (inputs, cache))."""
    import torch

    from vllm.attention.backends.spyre_attn import (STATIC_DECODE,
                                                    _cache_kwargs)
    mask = torch.ones(batch, 1, ctx, dtype=torch.bool)
    slots = torch.tensor([ctx - 1])
    layers = [(layer_inputs(geo, batch, gen),
               tuple(torch.randn(batch, geo.kv_heads, ctx, geo.head_dim,
                                 generator=gen).to(torch.bfloat16)
                     for _ in range(2)))
              for _ in range(geo.layers)]
    return (STATIC_DECODE, batch,
            _cache_kwargs(STATIC_DECODE, mask, slots, None, None), layers)


def paged_case(geo: Geometry, batch: int, ctx: int, gen):
    import torch

    from vllm.attention.backends.spyre_attn import PAGED, _cache_kwargs
    from vllm.config.spyre import CB_BLOCK_SIZE
    from vllm.worker.spyre_cb_inputs import decode_batch
    width = -(-ctx // CB_BLOCK_SIZE)
    blocks = batch * width + 1
    tables = torch.randperm(blocks - 1, generator=gen).view(batch, width)
    step = decode_batch([0] * batch, [ctx] * batch, tables.tolist(),
                        CB_BLOCK_SIZE, width, 0, blocks - 1)
    rows = step.input_ids.shape[0]
    layers = [(layer_inputs(geo, rows, gen),
               tuple(torch.randn(blocks * CB_BLOCK_SIZE, geo.kv_heads,
                                 geo.head_dim, generator=gen).to(
                                     torch.bfloat16) for _ in range(2)))
              for _ in range(geo.layers)]
    return (PAGED, rows,
            _cache_kwargs(PAGED, None, step.cache_slots, step.block_table,
                          step.ctx_lens), layers)


def fms_ops(kind: str, after: bool):
    """FMS's store and decode compute ops of a step of ``kind``: the CPU
    kernel's (before) or ``eager``'s (after)."""
    from fms.modules import attention

    from vllm.attention.backends.spyre_attn import PAGED
    from vllm.attention.ops import spyre_paged_cache as paged_cache
    from vllm.attention.ops import spyre_static_cache as static_cache
    module = paged_cache if kind == PAGED else static_cache
    module.register()
    ops = attention.get_attention_type(
        attn_name=module.ATTN_NAME_EAGER_KERNEL if after else
        module.ATTN_NAME_CPU_KERNEL)
    return ops["store"], ops["compute_decode"]


def best_pass(impl, case, code: str, after: bool, repeats: int):
    """Best time of one step over every layer (on copies of the caches)
    on ``code``'s ops (``vllm`` or ``fms``), before or after, and its
    outputs and caches."""
    from vllm.attention.backends.spyre_attn import _ops
    kind, rows, kwargs, layers = case
    caches = [tuple(c.clone() for c in cache) for _, cache in layers]
    if code == "vllm":
        ops = _ops(kind, True, after)

        def layer(inputs, cache):
            return impl.attend(*inputs, cache, kind, rows, 1, kwargs, ops)
    else:
        store, compute = fms_ops(kind, after)
        H, KVH, D = impl.num_heads, impl.num_kv_heads, impl.head_size

        def layer(inputs, cache):
            q, k, v = inputs
            keys, values, _, _ = store(k.view(rows, 1, KVH, D),
                                       v.view(rows, 1, KVH, D), *cache,
                                       **kwargs)
            return compute(q.view(rows, 1, H, D), keys, values, H, KVH, 0.0,
                           impl.scale, **kwargs)

    def step():
        return [layer(inputs, cache)
                for (inputs, _), cache in zip(layers, caches)]

    outputs = step()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - start)
    return best, outputs, caches


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--batch-sizes", type=parse_ints, default=[1, 4])
    ap.add_argument("--contexts", type=parse_ints, default=[128, 512])
    ap.add_argument("--repeats", type=int, default=20)
    add_json_option(ap, "cache_step.json")
    args = ap.parse_args()

    import torch
    if not native_kernels_available():
        return 1
    from vllm.attention.backends.spyre_attn import SpyreAttentionImpl
    torch.set_num_threads(cores())
    geo = Geometry.of(args.model)
    impl = SpyreAttentionImpl(geo.heads, geo.head_dim, geo.head_dim**-0.5,
                              geo.kv_heads)
    gen = torch.Generator().manual_seed(0)
    results, mismatches = [], 0
    with torch.no_grad():
        for ctx in args.contexts:
            for b in args.batch_sizes:
                for (name, build), code in itertools.product(
                        (("static decode", static_case),
                         ("paged decode", paged_case)), ("vllm", "fms")):
                    case = build(geo, b, ctx, gen)
                    two, out2, caches2 = best_pass(impl, case, code, False,
                                                   args.repeats)
                    one, out1, caches1 = best_pass(impl, case, code, True,
                                                   args.repeats)
                    same = all(torch.equal(a, c) for a, c in
                               zip(out1, out2)) and all(
                                   torch.equal(a, c)
                                   for x, y in zip(caches1, caches2)
                                   for a, c in zip(x, y))
                    mismatches += not same
                    results.append(dict(case=name, code=code, batch=b,
                                        ctx=ctx,
                                        before_s=two, after_s=one,
                                        same=same))
                    print(f"{name} ({code}) B={b} ctx={ctx}: before "
                          f"{two * 1e3:.3f} ms, after {one * 1e3:.3f} ms",
                          flush=True)
    rows = [[r["case"], r["code"], r["batch"], r["ctx"],
             f"{r['before_s'] * 1e3:.3f}",
             f"{r['after_s'] * 1e3:.3f}",
             f"{(r['before_s'] - r['after_s']) * 1e3:.3f}",
             f"{r['before_s'] / r['after_s']:.2f}x",
             "yes" if r["same"] else "NO"] for r in results]
    write_json(args.json, dict(args=vars(args), machine=machine_info(),
                               geometry=vars(geo), results=results))
    print(f"\n{geo.layers} layers, {geo.heads} query / {geo.kv_heads} "
          f"key-value heads of {geo.head_dim}, bfloat16 caches, best of "
          f"{args.repeats}, {cores()} cores; times are one step over every "
          "layer")
    print(table(["case", "code", "B", "ctx", "before ms", "after ms",
                 "saved ms", "before/after", "same"], rows))
    if mismatches:
        print(f"FAILED: {mismatches} case(s) where the two differ")
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
