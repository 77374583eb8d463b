"""The Spyre attention backend of vLLM's own model code (``--model-impl
vllm``).

vLLM's model classes (``LlamaForCausalLM``, ``Qwen2ForCausalLM``, ...)
attend through ``vllm.attention.Attention`` layers, which ask the platform
for a backend (``SpyrePlatform.get_attn_backend_cls``) and call its
``AttentionImpl`` with the step's ``AttentionMetadata``.  This backend
serves both Spyre modes over the caches the FMS path already uses, with
the same ops (``spyre_static_cache``, ``spyre_paged_cache``) and so the
same C++ kernels:

* static batching: each layer's cache is the ``(keys, values)`` pair of
  one warm-up shape, each ``[B, kv_heads, T, head_size]``
  (``CacheLayout``), written at the step's ``cache_slots`` and read under
  the step's mask;
* continuous batching: each layer's cache is the ``(keys, values)`` pair
  of the block pool, each ``[blocks * block_size, kv_heads, head_size]``
  (``PoolLayout``; ``get_kv_cache_shape`` states the two together),
  written at the step's slots and read through its block tables;
* no cache (a prompt scored whole for its prompt log-probabilities):
  causal attention over the prompt's own positions.

vLLM's models flatten a step to ``[num_tokens, ...]``; the step says how
those tokens form ``B`` rows of ``L`` positions.  Inside the compiled
model each ``Attention`` layer is an ``InlineAttention``: it reads the
step's tensors and the caches from the ``AttentionStep`` the model's
forward fills from its own inputs, so they are graph inputs, as they are
for FMS, and the cache ops and kernels run inline in the graph, with no
call back into Python per layer (vLLM's opaque ``unified_attention`` op
and its forward context would cost one per layer and step).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Tuple, Type

import torch
import torch.nn.functional as F
from torch import nn

from vllm.attention.backends.abstract import (AttentionBackend,
                                              AttentionImpl,
                                              AttentionMetadata,
                                              AttentionMetadataBuilder,
                                              AttentionType)
from vllm.attention.backends.utils import CommonAttentionState
from vllm.attention.ops import spyre_paged_cache as paged_cache
from vllm.attention.ops import spyre_static_cache as static_cache
from vllm.attention.ops.spyre_paged_inputs import PagedInputs
from vllm.attention.ops.spyre_torch_ops import causal_mask

#: What a step's metadata describes.
STATIC_PREFILL = "static-prefill"
STATIC_DECODE = "static-decode"
PAGED = "paged"
CAUSAL = "causal"


class SpyreAttentionBackend(AttentionBackend):
    """vLLM's attention interface over the Spyre caches."""

    accept_output_buffer = False

    @staticmethod
    def get_name() -> str:
        return "SPYRE"

    @staticmethod
    def get_impl_cls() -> Type["SpyreAttentionImpl"]:
        return SpyreAttentionImpl

    @staticmethod
    def get_metadata_cls() -> Type["SpyreAttentionMetadata"]:
        return SpyreAttentionMetadata

    @staticmethod
    def get_builder_cls() -> Type["SpyreAttentionMetadataBuilder"]:
        return SpyreAttentionMetadataBuilder

    @staticmethod
    def get_state_cls() -> Type[CommonAttentionState]:
        return CommonAttentionState

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int,
                           num_kv_heads: int,
                           head_size: int) -> Tuple[int, ...]:
        """A layer's block pool: keys and values, one row per slot."""
        return (2, num_blocks * block_size, num_kv_heads, head_size)

    @staticmethod
    def swap_blocks(src_kv_cache: torch.Tensor, dst_kv_cache: torch.Tensor,
                    src_to_dst: torch.Tensor) -> None:
        raise NotImplementedError(
            "Swapping key/value blocks is not supported on Spyre: preempted "
            "sequences are recomputed")

    @staticmethod
    def copy_blocks(kv_caches: List[torch.Tensor],
                    src_to_dists: torch.Tensor) -> None:
        raise NotImplementedError(
            "Copying key/value blocks (beam search) is not supported on "
            "Spyre")


@dataclass
class SpyreAttentionMetadata(AttentionMetadata):
    """One step: ``rows`` x ``length`` positions, flattened in the model.

    ``kind`` is one of ``STATIC_PREFILL``, ``STATIC_DECODE``, ``PAGED`` and
    ``CAUSAL``.  Static steps carry ``mask`` (``[B, L, T]``, True =
    attend) and ``cache_slots`` (``[L]``); paged steps ``cache_slots``
    (``[B, L]``, pool slots), ``block_table`` and ``ctx_lens``.
    ``on_kernel``: the C++ kernels attend (else torch ops); ``fused``:
    with ``on_kernel``, a decode or paged step writes the cache and attends
    in one C++ call (``_ops``)."""

    kind: str = CAUSAL
    rows: int = 1
    length: int = 0
    mask: Optional[torch.Tensor] = None
    cache_slots: Optional[torch.Tensor] = None
    block_table: Optional[torch.Tensor] = None
    ctx_lens: Optional[torch.Tensor] = None
    on_kernel: bool = False
    fused: bool = False

    @property
    def prefill_metadata(self) -> Optional["SpyreAttentionMetadata"]:
        return self if self.num_prefills else None

    @property
    def decode_metadata(self) -> Optional["SpyreAttentionMetadata"]:
        return self if self.num_decode_tokens else None


def _cache_kwargs(kind: str, mask, cache_slots, block_table,
                  ctx_lens) -> dict:
    """The keyword arguments the Spyre cache ops read."""
    return dict(mask=mask, cache_slots=cache_slots, block_table=block_table,
                ctx_lens=ctx_lens, spyre_prefill=kind == STATIC_PREFILL)


def _ops(kind: str, on_kernel: bool, fused: bool = False) -> tuple:
    """The (store, compute) cache ops of a step of ``kind``; with
    ``fused`` (and ``on_kernel``), ``(None, store_and_attend)`` for a
    static decode or a paged step: the cache write and the attention in
    one C++ call, where ``eager`` would dispatch 17 ops a layer."""
    if fused and on_kernel and kind in (STATIC_DECODE, PAGED):
        return (None, (paged_cache if kind == PAGED else
                       static_cache).store_and_attend)
    if kind == PAGED:
        return (paged_cache.store, paged_cache.compute_kernel
                if on_kernel else paged_cache.compute)
    if kind == CAUSAL:
        return (None, None)
    return (static_cache.store,
            static_cache.compute_op(kind == STATIC_PREFILL, on_kernel))


def _metadata(kind: str, rows: int, length: int, prefills: int,
              decodes: int, **tensors) -> SpyreAttentionMetadata:
    slots = tensors.get("cache_slots")
    return SpyreAttentionMetadata(
        num_prefills=prefills,
        num_prefill_tokens=prefills * length,
        num_decode_tokens=decodes,
        slot_mapping=slots.flatten() if slots is not None else
        torch.empty(0, dtype=torch.long),
        multi_modal_placeholder_index_maps=None,
        enable_kv_scales_calculation=False,
        kind=kind, rows=rows, length=length, **tensors)


class SpyreAttentionMetadataBuilder(
        AttentionMetadataBuilder[SpyreAttentionMetadata]):
    """Builds a step's metadata from the Spyre runners' step inputs: a
    static step (``static``), a paged one (``paged``) or a whole prompt
    without a cache (``causal``), given to ``add`` before ``build``."""

    def __init__(self, input_builder: Any = None,
                 on_kernel: bool = False, fused: bool = False) -> None:
        self.input_builder = input_builder
        self.on_kernel = on_kernel
        self.fused = fused
        self._step: Optional[SpyreAttentionMetadata] = None

    def prepare(self) -> None:
        self._step = None

    def static(self, input_ids: torch.Tensor, mask: torch.Tensor,
               cache_slots: torch.Tensor, is_prompt: bool) -> None:
        rows, length = input_ids.shape
        self._step = _metadata(
            STATIC_PREFILL if is_prompt else STATIC_DECODE, rows, length,
            rows if is_prompt else 0, 0 if is_prompt else rows,
            mask=mask, cache_slots=cache_slots, on_kernel=self.on_kernel,
            fused=self.fused)

    def paged(self, step: PagedInputs) -> None:
        rows, length = step.input_ids.shape
        decode = length == 1
        self._step = _metadata(
            PAGED, rows, length, 0 if decode else rows, rows if decode else 0,
            cache_slots=step.cache_slots, block_table=step.block_table,
            ctx_lens=step.ctx_lens, on_kernel=self.on_kernel,
            fused=self.fused)

    def causal(self, length: int) -> None:
        self._step = _metadata(CAUSAL, 1, length, 1, 0)

    def build(self, seq_lens: List[int], query_lens: List[int],
              cuda_graph_pad_size: int,
              batch_size: int) -> SpyreAttentionMetadata:
        """The metadata of the step added last.  vLLM's arguments are
        ignored: the Spyre step inputs already fix every length, and no
        CUDA graph pads them."""
        if self._step is None:
            raise RuntimeError("build() before a step was added")
        step, self._step = self._step, None
        return step


class SpyreAttentionImpl(AttentionImpl[SpyreAttentionMetadata]):
    """Decoder self-attention over the Spyre caches."""

    def __init__(self,
                 num_heads: int,
                 head_size: int,
                 scale: float,
                 num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[List[float]] = None,
                 sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 **extra: Any) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            f"a key/value cache dtype of {kv_cache_dtype!r}":
            kv_cache_dtype != "auto",
            f"a logits soft cap ({logits_soft_cap})":
            logits_soft_cap not in (None, 0, 0.0),
            f"attention type {attn_type!r}":
            attn_type != AttentionType.DECODER,
            "key/value sharing between layers":
            kv_sharing_target_layer_name is not None,
            f"attention options {sorted(extra)}": bool(
                {k: v for k, v in extra.items() if v is not None}),
        }
        named = [what for what, used in unsupported.items() if used]
        if named:
            raise NotImplementedError(
                f"{', '.join(named)} in attention "
                f"{'is' if len(named) == 1 else 'are'} not supported on "
                "Spyre (vLLM's model code, --model-impl vllm)")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        #: This layer's sliding window (0: whole context), given to the
        #: Spyre cache ops as ``spyre_window``: vLLM's per-layer window,
        #: else the model's (``use_model_window``).
        self.window = sliding_window or 0

    def use_model_window(self, window: int) -> None:
        """The model's sliding window, for a layer vLLM gave none: the
        platform clears vLLM's own window setting, from which vLLM's
        layers without a per-layer window (Mistral's) would take it."""
        if not self.window:
            self.window = window

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: SpyreAttentionMetadata,
                output: Optional[torch.Tensor] = None,
                output_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """vLLM's interface (``unified_attention``): the step described by
        ``attn_metadata``.  The Spyre models call ``attend`` instead
        (``InlineAttention``)."""
        meta = attn_metadata
        return self.attend(
            query, key, value, kv_cache, meta.kind, meta.rows, meta.length,
            _cache_kwargs(meta.kind, meta.mask, meta.cache_slots,
                          meta.block_table, meta.ctx_lens),
            _ops(meta.kind, meta.on_kernel, meta.fused))

    def attend(self, query: torch.Tensor, key: torch.Tensor,
               value: torch.Tensor, kv_cache, kind: str, rows, length,
               cache_kwargs: dict, ops: tuple) -> torch.Tensor:
        """query: [N, heads * head_size]; key, value: [N, kv_heads *
        head_size], N = rows * length; ``kv_cache``: this layer's ``(keys,
        values)`` (None for ``CAUSAL``).  Returns [N, heads * head_size]."""
        kwargs = cache_kwargs
        if self.window:
            kwargs = {**kwargs, "spyre_window": self.window}
        store, compute = ops
        if kind != CAUSAL and store is None:
            # One call writes the cache and attends.
            return compute(query, key, value, kv_cache[0], kv_cache[1],
                           self.num_heads, self.scale, **kwargs)
        B, L = rows, length
        q = query.view(B, L, self.num_heads, self.head_size)
        k = key.view(B, L, self.num_kv_heads, self.head_size)
        v = value.view(B, L, self.num_kv_heads, self.head_size)
        if kind == CAUSAL:
            mask = causal_mask(L, self.window) if self.window else None
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                attn_mask=mask, is_causal=mask is None, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads
            ).transpose(1, 2)
            return out.reshape(B * L, -1)
        keys, values, _, _ = store(k, v, kv_cache[0], kv_cache[1], **kwargs)
        out = compute(q, keys, values, self.num_heads, self.num_kv_heads,
                      0.0, self.scale, **kwargs)
        return out.reshape(B * L, -1)


class AttentionStep:
    """The step a Spyre model on vLLM's model code is running, as its
    attention layers read it: filled by the model's forward from its own
    inputs (``begin``), inside the compiled code, so that the step's
    tensors and the caches are the graph's inputs; emptied at its end."""

    def __init__(self, on_kernel: bool, fused: bool = False) -> None:
        self.on_kernel = on_kernel
        self.fused = fused
        self.end()

    def begin(self, kind: str, rows, length, caches: Optional[list] = None,
              mask: Optional[torch.Tensor] = None,
              cache_slots: Optional[torch.Tensor] = None,
              block_table: Optional[torch.Tensor] = None,
              ctx_lens: Optional[torch.Tensor] = None) -> None:
        """A step of ``kind`` over ``rows`` x ``length`` positions;
        ``caches``: each layer's ``(keys, values)`` (None for ``CAUSAL``)."""
        self.kind = kind
        self.rows = rows
        self.length = length
        self.caches = caches
        self.cache_kwargs = _cache_kwargs(kind, mask, cache_slots,
                                          block_table, ctx_lens)
        self.ops = _ops(kind, self.on_kernel, self.fused)

    def end(self) -> None:
        self.kind: Optional[str] = None
        self.rows = self.length = 0
        self.caches: Optional[list] = None
        self.cache_kwargs: dict = {}
        self.ops: tuple = (None, None)


class InlineAttention(nn.Module):
    """One of vLLM's ``Attention`` layers (the ``index``-th of the model),
    attending in the step ``step`` holds: what the model calls in the
    layer's place (``inline_attention``)."""

    def __init__(self, layer: nn.Module, index: int,
                 step: AttentionStep) -> None:
        super().__init__()
        self.layer = layer
        self.index = index
        self.step = step

    def forward(self, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor,
                output_shape: Optional[torch.Size] = None) -> torch.Tensor:
        if output_shape is not None:
            raise NotImplementedError(
                "an attention output shape other than the query's (MLA) is "
                "not supported on Spyre")
        step = self.step
        if step.kind is None:
            raise RuntimeError(f"attention layer {self.layer.layer_name} "
                               "called outside a Spyre step")
        cache = step.caches[self.index] if step.caches is not None else None
        return self.layer.impl.attend(query, key, value, cache, step.kind,
                                      step.rows, step.length,
                                      step.cache_kwargs, step.ops)


def inline_attention(model: nn.Module, step: AttentionStep) -> list:
    """Puts an ``InlineAttention`` in the place of each of ``model``'s
    ``Attention`` layers, the ``i``-th of ``model.modules()`` reading the
    ``i``-th cache; returns those layers, in that order."""
    from vllm.attention import Attention
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    inline = {
        id(layer): InlineAttention(layer, i, step)
        for i, layer in enumerate(layers)
    }
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, Attention):
                setattr(parent, name, inline[id(child)])
    return layers
