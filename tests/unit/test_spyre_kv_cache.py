"""The in-place key/value cache against FMS's own growing cache.

A tiny random FMS LLaMA (grouped-query attention, two layers) generates
greedily twice from the same left-padded batch: once with FMS's default
attention (``sdpa_causal``, the cache concatenated every token) and once
with the Spyre op (cache allocated once, written in place, fixed-shape
masks from ``spyre_static_inputs``).  Logits and ids must agree.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm.attention.ops import spyre_kv_layout as kv_layout
from vllm.attention.ops import spyre_static_cache as static_cache
from vllm.config.spyre import WarmupShape
from vllm.worker.spyre_static_inputs import decode_inputs, prefill_inputs

from spyre_support.tiny_models import build_tiny_fms


@pytest.fixture(scope="module")
def tiny_fms():
    static_cache.register()
    return build_tiny_fms(64)


def _fms_reference(model, prompts, shape, steps):
    """FMS default attention: cache concatenated per token."""
    pre = prefill_inputs(prompts, shape, pad_id=0)
    logits, cache = model(pre.input_ids, position_ids=pre.position_ids,
                          past_key_value_states=None, use_cache=True,
                          last_n_tokens=1, mask=pre.mask)
    out = [logits[:, -1]]
    lens = [len(p) for p in prompts]
    for step in range(1, steps):
        dec = decode_inputs(out[-1].argmax(-1).tolist(), lens, shape, step)
        kv_len = shape.prompt_len + step  # what the grown cache holds
        logits, cache = model(dec.input_ids, position_ids=dec.position_ids,
                              past_key_value_states=cache, use_cache=True,
                              last_n_tokens=1, mask=dec.mask[:, :, :kv_len])
        out.append(logits[:, -1])
    return out


def _static(model, prompts, shape, steps, cache, attn_name):
    pre = prefill_inputs(prompts, shape, pad_id=0)
    kwargs = dict(use_cache=True, last_n_tokens=1, attn_name=attn_name)
    logits, returned = model(pre.input_ids, position_ids=pre.position_ids,
                             past_key_value_states=cache, mask=pre.mask,
                             cache_slots=pre.cache_slots, spyre_prefill=True,
                             **kwargs)
    assert all(k is ck and v is cv
               for (k, v), (ck, cv) in zip(returned, cache))
    out = [logits[:, -1]]
    lens = [len(p) for p in prompts]
    for step in range(1, steps):
        dec = decode_inputs(out[-1].argmax(-1).tolist(), lens, shape, step)
        logits, _ = model(dec.input_ids, position_ids=dec.position_ids,
                          past_key_value_states=cache, mask=dec.mask,
                          cache_slots=dec.cache_slots, spyre_prefill=False,
                          **kwargs)
        out.append(logits[:, -1])
    return out


def _attn_names():
    from vllm.spyre_kernels import ops as native
    kernel = pytest.param(
        static_cache.ATTN_NAME_CPU_KERNEL,
        marks=pytest.mark.skipif(not native.available(),
                                 reason="no C++ compiler for the kernel"))
    eager_kernel = pytest.param(
        static_cache.ATTN_NAME_EAGER_KERNEL,
        marks=pytest.mark.skipif(not native.available(),
                                 reason="no C++ compiler for the kernel"))
    return [static_cache.ATTN_NAME, kernel, eager_kernel]


@torch.inference_mode()
@pytest.mark.parametrize("attn_name", _attn_names())
def test_static_cache_matches_fms_growing_cache(tiny_fms, attn_name):
    shape = WarmupShape(prompt_len=8, new_tokens=6, batch_size=3)
    prompts = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    layout = kv_layout.CacheLayout.of(tiny_fms)
    assert (layout.layers, layout.kv_heads, layout.k_head_dim) == (2, 2, 16)
    cache = layout.allocate(3, shape.prompt_len + shape.new_tokens,
                            torch.float32)
    ptrs = [(k.data_ptr(), v.data_ptr()) for k, v in cache]
    ref = _fms_reference(tiny_fms, prompts, shape, shape.new_tokens)
    got = _static(tiny_fms, prompts, shape, shape.new_tokens, cache,
                  attn_name)
    for step, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5,
                                   msg=f"step {step}")
    # Written in place: same buffers.  The prompt and G - 1 decode steps
    # wrote every slot but the last (the last token is never fed back).
    assert [(k.data_ptr(), v.data_ptr()) for k, v in cache] == ptrs
    written = cache[0][0][1].abs().sum(-1).ne(0)  # row 1: a full prompt
    assert written[:, :-1].all() and not written[:, -1].any()

    # A second batch of the same shape reuses the cache: the stale slots
    # of the first batch must not leak into it.
    again = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9, 3]]
    ref2 = _fms_reference(tiny_fms, again, shape, shape.new_tokens)
    got2 = _static(tiny_fms, again, shape, shape.new_tokens, cache,
                   attn_name)
    for a, b in zip(ref2, got2):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_written_out_decode_attention_matches_sdpa():
    gen = torch.Generator().manual_seed(0)
    B, H, kvh, D, T = 3, 9, 3, 16, 20
    q = torch.randn(B, 1, H, D, generator=gen)
    k = torch.randn(B, kvh, T, D, generator=gen)
    v = torch.randn(B, kvh, T, D, generator=gen)
    mask = torch.rand(B, 1, T, generator=gen) > 0.4
    mask[..., 0] = True
    got = static_cache._compute_decode(q, k, v, H, kvh, 0.0, None,
                                         mask=mask)
    ref = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.repeat_interleave(H // kvh, 1),
        v.repeat_interleave(H // kvh, 1), attn_mask=mask.unsqueeze(1))
    torch.testing.assert_close(got, ref.transpose(1, 2))


def test_cache_size():
    layout = kv_layout.CacheLayout(layers=30, kv_heads=3,
                                        k_head_dim=64, v_head_dim=64)
    cache = layout.allocate(2, 10, torch.float32)
    assert len(cache) == 30 and cache[0][0].shape == (2, 3, 10, 64)
    assert layout.nbytes(2, 10, torch.float32) == sum(
        k.nbytes + v.nbytes for k, v in cache)
