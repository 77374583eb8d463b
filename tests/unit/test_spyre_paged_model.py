"""A tiny FMS LLaMA over the paged key/value pool of continuous batching:
prefilled chunk by chunk (the card, the torch ops) or in one pass, and decoding
sequences of different lengths in one batch (one joining mid-way), it gives
the logits and greedy tokens of FMS's own forward over the whole sequence,
with both attention ops."""
from __future__ import annotations

import pytest
import torch

from vllm.attention.ops import spyre_kv_layout as kv_layout
from vllm.spyre_kernels import ops as native
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops.spyre_kv_layout import CacheLayout
from vllm.config.spyre import CB_BLOCK_SIZE
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.core.spyre_cb_blocks import blocks_needed
from vllm.worker.spyre_cb_inputs import (decode_batch,
                                         prefill_chunks,
                                         whole_prefill_len)

from spyre_support.tiny_models import build_tiny_fms

BS = CB_BLOCK_SIZE
needs_kernel = pytest.mark.skipif(not native.available(),
                                  reason="no C++ compiler for the kernel")


@pytest.fixture(scope="module")
def tiny_fms():
    paged_cache.register()
    return build_tiny_fms(256)


class PagedRun:
    """Sequences sharing one pool, driven as the CB runner drives them."""

    def __init__(self, model, attn_name, blocks=9, max_blocks=4, seed=0,
                 whole=False):
        self.model, self.attn_name = model, attn_name
        #: Prefill in one pass (as on the paged kernel) instead of 64-token
        #: chunks.
        self.whole = whole
        layout = kv_layout.PoolLayout(CacheLayout.of(model))
        self.pool = layout.allocate(blocks, torch.float32)
        gen = torch.Generator().manual_seed(seed)
        for k, v in self.pool:  # stale values of earlier sequences
            k.copy_(torch.randn(k.shape, generator=gen))
            v.copy_(torch.randn(v.shape, generator=gen))
        self.pad_block = blocks - 1
        self.free = torch.randperm(self.pad_block, generator=gen).tolist()
        self.max_blocks = max_blocks
        self.tables: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def _forward(self, step: PagedInputs) -> torch.Tensor:
        logits, cache = self.model(
            step.input_ids, position_ids=step.position_ids,
            past_key_value_states=self.pool, use_cache=True,
            last_n_tokens=1, attn_name=self.attn_name,
            cache_slots=step.cache_slots, block_table=step.block_table,
            ctx_lens=step.ctx_lens)
        assert all(k is pk and v is pv
                   for (k, v), (pk, pv) in zip(cache, self.pool))
        return logits[:, -1]  # [B, vocab]

    def _grow(self, name):
        while blocks_needed(len(self.tokens[name]),
                            BS) > len(self.tables[name]):
            self.tables[name].append(self.free.pop())

    def prefill(self, name, prompt):
        self.tokens[name] = list(prompt)
        self.tables[name] = []
        self._grow(name)
        chunks = prefill_chunks(
            prompt, self.tables[name], BS, self.max_blocks, 0, self.pad_block,
            whole_prefill_len(len(prompt)) if self.whole else BS)
        for c in range(chunks.input_ids.shape[0]):
            logits = self._forward(chunks.row(c))
        self.logits[name] = [logits[0]]
        self.tokens[name].append(int(logits[0].argmax()))

    def decode(self, names):
        for name in names:
            self._grow(name)
        step = decode_batch([self.tokens[n][-1] for n in names],
                            [len(self.tokens[n]) for n in names],
                            [self.tables[n] for n in names], BS,
                            self.max_blocks, 0, self.pad_block)
        logits = self._forward(step)
        assert logits.shape[0] == max(len(names), 2)
        for i, name in enumerate(names):
            self.logits[name].append(logits[i])
            self.tokens[name].append(int(logits[i].argmax()))


def _attn_names():
    kernel = pytest.param(paged_cache.ATTN_NAME_CPU_KERNEL,
                          marks=needs_kernel)
    eager_kernel = pytest.param(paged_cache.ATTN_NAME_EAGER_KERNEL,
                                marks=needs_kernel)
    return [paged_cache.ATTN_NAME, kernel, eager_kernel]


@torch.inference_mode()
@pytest.mark.parametrize("whole", [False, True], ids=["chunks", "whole"])
@pytest.mark.parametrize("attn_name", _attn_names())
def test_tiny_fms_paged_matches_fms_forward(tiny_fms, attn_name, whole):
    gen = torch.Generator().manual_seed(1)
    prompts = {
        "a": torch.randint(1, 96, (62, ), generator=gen).tolist(),
        "b": torch.randint(1, 96, (130, ), generator=gen).tolist(),
        "c": torch.randint(1, 96, (5, ), generator=gen).tolist(),
        "d": torch.randint(1, 96, (1, ), generator=gen).tolist(),
    }
    run = PagedRun(tiny_fms, attn_name, blocks=10, whole=whole)
    run.prefill("a", prompts["a"])
    run.prefill("b", prompts["b"])
    for _ in range(4):  # a crosses from 1 block into 2 (64 -> 65 tokens)
        run.decode(["a", "b"])
    run.decode(["b"])  # b alone: a padding row
    run.prefill("c", prompts["c"])  # joins the running batch
    for _ in range(2):
        run.decode(["c", "b", "a"])
    run.prefill("d", prompts["d"])  # one token: padded in either way
    for _ in range(2):  # FMS disagrees with itself on 2-token inputs
        run.decode(["d", "c"])
    assert len(run.tables["a"]) == 2 and len(run.tables["b"]) == 3

    for name, prompt in prompts.items():
        tokens, logits = run.tokens[name], run.logits[name]
        n = len(prompt)
        # FMS's own forward, no cache, over the prompt and every output
        # token but the last (which was never fed back).
        ref = tiny_fms(torch.tensor([tokens[:-1]]), use_cache=False)[0]
        ref = ref[n - 1:]  # [outputs, vocab]
        assert len(logits) == ref.shape[0]
        torch.testing.assert_close(torch.stack(logits), ref, atol=1e-4,
                                   rtol=1e-4, msg=f"sequence {name}")
        assert tokens[n:] == ref.argmax(-1).tolist(), name
