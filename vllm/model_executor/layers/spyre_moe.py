"""Mixture-of-experts layers in a form every Spyre mode can compile.

FMS 1.13.1's ``MOEFeedForward`` hands each token to its top-k experts
through ``moe_mm``, whose CPU kernel selects tokens with data-dependent
masks.  Under ``torch.compile`` that specialises the graph on how many
tokens there are, so continuous batching's one decode graph with a dynamic
batch cannot be built; and under tensor parallelism FMS's sharded expert
layer does not accept the arguments ``MOEFeedForward`` passes it.

``DenseMOEFeedForward`` computes the same function with no shape that
depends on the data: every expert runs on every token, and the router's
weights (softmax, top-k, renormalised, as in FMS and Hugging Face) are
zero for the experts a token did not choose.  That costs
``num_experts / top_k`` times the expert FLOPs of a sparse kernel, but a
decode step reads every expert's weights anyway once the batch is a few
tokens wide; a prefill pays the full ``num_experts / top_k`` times.
Under tensor parallelism each rank holds a slice of every expert's inner
dimension (FMS's ``TPConditionalFeedForward`` sharding), computes its
partial sum and all-reduces it, as a sharded MLP does.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _classes() -> tuple[type, type]:
    """FMS's layer class, and the class its loaded layers are given."""
    from fms.modules.feedforward import MOEFeedForward
    dense = type("DenseMOEFeedForwardLayer",
                 (DenseMOEFeedForward, MOEFeedForward), {})
    # Precompiled graphs pickle their guards, and pickle finds a class by
    # its module and name.
    globals()[dense.__name__] = dense
    return MOEFeedForward, dense


def router_weights(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """``[T, E]`` weights of each token's experts from the router's
    ``[T, E]`` scores: softmax, keep the ``top_k`` largest, renormalise
    them to sum to 1; every other expert gets 0."""
    probs = F.softmax(scores, dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    top = top / top.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, chosen, top)


def dense_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
    """Router-weighted sum over all experts of ``w2 (silu(w1 x) * w3 x)``.

    ``x`` is ``[T, D]``; ``w13`` is ``[E, 2I, D]`` (``w1`` then ``w3``),
    ``w2`` is ``[E, D, I]``, ``weights`` is ``[T, E]``.  One expert at a
    time (``E`` is fixed, so the loop unrolls into the graph), so no
    ``[T, E, 2I]`` intermediate is ever held.
    """
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        gate, up = F.linear(x, w13[e]).chunk(2, dim=-1)
        hidden = F.silu(gate) * up * weights[:, e:e + 1]
        out = out + F.linear(hidden, w2[e])
    return out


def expert_sum(x: torch.Tensor, experts: nn.Module,
               weights: torch.Tensor) -> torch.Tensor:
    """``dense_experts`` over the weights of FMS's ``ConditionalFeedForward``
    ``experts``; a sharded one's (tensor parallelism) partial sum
    all-reduced over its group."""
    out = dense_experts(x, experts.w13, experts.w2, weights)
    group = getattr(experts, "group", None)
    if group is not None:
        from fms.distributed.tensorparallel import (
            reduce_from_tensor_model_parallel_region)
        out = reduce_from_tensor_model_parallel_region(out, group)
    return out


class DenseMOEFeedForward(nn.Module):
    """Methods that replace ``MOEFeedForward.forward`` on a loaded layer
    (``use_dense_experts`` swaps the instance's class), keeping its
    parameters, their sharding and their names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.dim)
        weights = router_weights(self.gate(flat), self.num_activated_experts)
        return expert_sum(flat, self.cond_ffn, weights).view(shape)


def use_dense_experts(model: nn.Module) -> int:
    """Makes every FMS mixture-of-experts layer of ``model`` dense; returns
    how many there were.  ``ValueError`` for a variant the dense form does
    not compute (expert biases, or top-k taken before the softmax)."""
    moe_class, dense_class = _classes()
    count = 0
    for name, module in model.named_modules():
        if type(module) is not moe_class:
            continue
        if module.use_bias or module.topk_first:
            raise ValueError(
                f"{name}: mixture-of-experts layers with expert biases or "
                "top-k before the softmax are not supported on Spyre.")
        module.__class__ = dense_class
        count += 1
    return count
