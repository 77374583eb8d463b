"""The Spyre attention backend of vLLM's model code (``spyre_attn``) on
its own: vLLM's flattened ``[tokens, heads * head_size]`` query, keys and
values against causal attention written out in float64, through the block
pool (a whole prefill, then a decode step; torch ops and the C++ kernel)
and through a static warm-up shape's cache (a left-padded prefill, then a
decode step), and without a cache; its vLLM interface; the options it
refuses."""
from __future__ import annotations

import pytest
import torch

from vllm.attention.backends.spyre_attn import (SpyreAttentionBackend,
                                                SpyreAttentionImpl,
                                                SpyreAttentionMetadata,
                                                SpyreAttentionMetadataBuilder)
from vllm.spyre_kernels import ops as native
from vllm.attention.ops.spyre_kv_layout import CacheLayout, PoolLayout
from vllm.config.spyre import CB_BLOCK_SIZE
from vllm.config.spyre_warmup_shapes import WarmupShape
from vllm.worker.spyre_cb_inputs import (decode_batch, prefill_chunks,
                                         whole_prefill_len)
from vllm.worker.spyre_static_inputs import DecodeSteps, prefill_inputs

H, KVH, D, N = 4, 2, 16, 90


def causal_reference(q, k, v, scale):
    """[N, H, D] float64 causal attention with grouped heads."""
    k = k.repeat_interleave(H // KVH, dim=1).double()
    v = v.repeat_interleave(H // KVH, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    future = torch.ones(N, N, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v).float()


@pytest.fixture
def qkv():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(N, H, D, generator=gen),
            torch.randn(N, KVH, D, generator=gen),
            torch.randn(N, KVH, D, generator=gen))


def flat(x):
    return x.reshape(x.shape[0], -1)


def test_without_a_cache_is_causal_attention(qkv):
    q, k, v = qkv
    impl = SpyreAttentionImpl(H, D, D**-0.5, KVH)
    builder = SpyreAttentionMetadataBuilder()
    builder.causal(N)
    meta = builder.build([], [], 0, 1)
    out = impl.forward(None, flat(q), flat(k), flat(v), None, meta)
    assert out.shape == (N, H * D)
    torch.testing.assert_close(out.view(N, H, D),
                               causal_reference(q, k, v, D**-0.5),
                               atol=1e-5, rtol=1e-5)


#: torch ops; the C++ kernel; the kernel with the cache write in the same
#: call (``fused``, vLLM's model code under ``eager``).
MODES = [(False, False), (True, False), (True, True)]


@pytest.mark.parametrize("on_kernel, fused", MODES)
def test_block_pool_prefill_then_decode(qkv, on_kernel, fused):
    if on_kernel and not native.available():
        pytest.skip("no C++ compiler for the kernel")
    q, k, v = qkv
    scale = D**-0.5
    pool = PoolLayout(CacheLayout(1, KVH, D, D)).allocate(5, torch.float32)[0]
    blocks, max_blocks, pad_block = [3, 0], 3, 4
    impl = SpyreAttentionImpl(H, D, scale, KVH)
    builder = SpyreAttentionMetadataBuilder(on_kernel=on_kernel,
                                            fused=fused)
    expected = causal_reference(q, k, v, scale)
    ids = list(range(N))
    # The prefill of the first N - 1 positions, in one row.
    step = prefill_chunks(ids[:-1], blocks, CB_BLOCK_SIZE, max_blocks, 0,
                          pad_block, whole_prefill_len(N - 1))
    rows, length = step.input_ids.shape
    assert rows == 1 and length == N - 1
    builder.paged(step)
    out = impl.forward(None, flat(q[:-1]), flat(k[:-1]), flat(v[:-1]), pool,
                       builder.build([], [], 0, 1))
    torch.testing.assert_close(out.view(N - 1, H, D), expected[:-1],
                               atol=1e-5, rtol=1e-5)
    # A decode step of the last position, beside a padding row.
    step = decode_batch([ids[-1]], [N], [blocks], CB_BLOCK_SIZE, max_blocks,
                        0, pad_block)
    builder.paged(step)
    meta = builder.build([], [], 0, step.input_ids.shape[0])
    pad = step.input_ids.shape[0] - 1

    def rows_of(x):
        return flat(torch.cat([x[-1:], torch.zeros(pad, *x.shape[1:])]))

    out = impl.forward(None, rows_of(q), rows_of(k), rows_of(v), pool, meta)
    torch.testing.assert_close(out[:1].view(1, H, D), expected[-1:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("on_kernel, fused", MODES)
def test_static_cache_prefill_then_decode(qkv, on_kernel, fused):
    """A warm-up shape's cache: a left-padded prefill of N - 1 positions
    (the shape's prompt length is longer), then the first decode step."""
    if on_kernel and not native.available():
        pytest.skip("no C++ compiler for the kernel")
    q, k, v = qkv
    scale = D**-0.5
    shape = WarmupShape(prompt_len=N + 6, new_tokens=4, batch_size=1)
    pads = shape.prompt_len - (N - 1)
    cache = CacheLayout(1, KVH, D, D).allocate(1, shape.max_len,
                                               torch.float32)[0]
    impl = SpyreAttentionImpl(H, D, scale, KVH)
    builder = SpyreAttentionMetadataBuilder(on_kernel=on_kernel,
                                            fused=fused)
    expected = causal_reference(q, k, v, scale)

    def padded(x):  # the pads' rows hold other values: they must not leak
        return flat(torch.cat([torch.randn(pads, *x.shape[1:]), x[:-1]]))

    step = prefill_inputs([list(range(N - 1))], shape, 0)
    builder.static(step.input_ids, step.mask, step.cache_slots, True)
    out = impl.forward(None, padded(q), padded(k), padded(v), cache,
                       builder.build([], [], 0, 1))
    torch.testing.assert_close(out[pads:].view(N - 1, H, D), expected[:-1],
                               atol=1e-5, rtol=1e-5)
    step = DecodeSteps([N - 1], shape).inputs([N - 1], 1)
    builder.static(step.input_ids, step.mask, step.cache_slots, False)
    out = impl.forward(None, flat(q[-1:]), flat(k[-1:]), flat(v[-1:]),
                       cache, builder.build([], [], 0, 1))
    torch.testing.assert_close(out.view(1, H, D), expected[-1:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_fused_step_equals_the_two_cache_ops(cache_dtype):
    """The one-call cache write and attention gives the separate ops'
    output and leaves the same cache, bit for bit: a static decode step of
    3 rows, a paged decode step of 2 sequences and a paged prefill, the
    query, keys and values strided views of one fused projection, as
    vLLM's model code splits them."""
    if not native.available():
        pytest.skip("no C++ compiler for the kernel")
    gen = torch.Generator().manual_seed(1)
    impl = SpyreAttentionImpl(H, D, D**-0.5, KVH)

    def projection(tokens):
        qkv = torch.randn(tokens, (H + 2 * KVH) * D, generator=gen)
        return qkv.split([H * D, KVH * D, KVH * D], dim=-1)

    def both(kind_inputs, cache, meta_of):
        outs, caches = [], []
        for fused in (False, True):
            builder = SpyreAttentionMetadataBuilder(on_kernel=True,
                                                    fused=fused)
            kind_inputs(builder)
            copy = tuple(c.clone() for c in cache)
            outs.append(impl.forward(None, *meta_of[0], copy,
                                     builder.build([], [], 0, 1)))
            caches.append(copy)
        assert torch.equal(outs[0], outs[1])
        for a, b in zip(*caches):
            assert torch.equal(a, b)
        return caches[1]

    # Static: 3 rows, their prompts written before; this step writes the
    # first new token's keys and values.
    shape = WarmupShape(prompt_len=5, new_tokens=3, batch_size=3)
    cache = CacheLayout(1, KVH, D, D).allocate(3, shape.max_len,
                                               cache_dtype)[0]
    for c in cache:
        c.copy_(torch.randn(c.shape, generator=gen).to(cache_dtype))
    step = DecodeSteps([5, 4, 3], shape).inputs([5, 4, 3], 1)
    after = both(lambda b: b.static(step.input_ids, step.mask,
                                    step.cache_slots, False),
                 cache, [projection(3)])
    assert not torch.equal(after[0], cache[0])  # the step wrote its keys

    # Paged: two sequences decoding, then a prefill of 30 tokens.
    pool = PoolLayout(CacheLayout(1, KVH, D, D)).allocate(6, cache_dtype)[0]
    for c in pool:
        c.copy_(torch.randn(c.shape, generator=gen).to(cache_dtype))
    step = decode_batch([7, 8], [20, 9], [[0, 1], [2]], CB_BLOCK_SIZE, 3, 0,
                        5)
    both(lambda b: b.paged(step), pool,
         [projection(step.input_ids.numel())])
    step = prefill_chunks(list(range(30)), [3, 4], CB_BLOCK_SIZE, 3, 0, 5,
                          whole_prefill_len(30))
    both(lambda b: b.paged(step), pool,
         [projection(step.input_ids.numel())])


def test_metadata_counts_prefills_and_decodes():
    builder = SpyreAttentionMetadataBuilder()
    step = decode_batch([5, 6, 7], [3, 9, 70], [[0], [1], [2, 3]],
                        CB_BLOCK_SIZE, 2, 0, 4)
    builder.paged(step)
    meta = builder.build([], [], 0, 3)
    assert isinstance(meta, SpyreAttentionMetadata)
    assert (meta.num_prefills, meta.num_decode_tokens) == (0, 3)
    assert meta.decode_metadata is meta and meta.prefill_metadata is None
    assert meta.slot_mapping.tolist() == step.cache_slots.flatten().tolist()
    with pytest.raises(RuntimeError, match="before a step"):
        builder.build([], [], 0, 3)


def test_backend_interface():
    """What vLLM's V0 interface asks of a backend (``get_kv_cache_shape``
    states the pool's layout: the runners allocate it through
    ``PoolLayout``, keys and values apart, of that size)."""
    backend = SpyreAttentionBackend
    assert backend.get_impl_cls() is SpyreAttentionImpl
    assert backend.get_metadata_cls() is SpyreAttentionMetadata
    assert backend.get_builder_cls() is SpyreAttentionMetadataBuilder
    assert backend.get_kv_cache_shape(10, CB_BLOCK_SIZE, 3, 64) == (
        2, 10 * CB_BLOCK_SIZE, 3, 64)
    with pytest.raises(NotImplementedError, match="recomputed"):
        backend.swap_blocks(torch.empty(0), torch.empty(0), torch.empty(0))


@pytest.mark.parametrize("options, named", [
    (dict(alibi_slopes=[1.0] * H), "ALiBi slopes"),
    (dict(logits_soft_cap=30.0), "a logits soft cap (30.0)"),
    (dict(kv_cache_dtype="fp8"), "a key/value cache dtype of 'fp8'"),
    (dict(attn_type="encoder_only"), "attention type 'encoder_only'"),
    (dict(sinks=torch.zeros(H)), "attention options ['sinks']"),
])
def test_unsupported_options_are_named(options, named):
    with pytest.raises(NotImplementedError) as info:
        SpyreAttentionImpl(H, D, D**-0.5, KVH, **options)
    assert named in str(info.value)
    assert "--model-impl vllm" in str(info.value)
