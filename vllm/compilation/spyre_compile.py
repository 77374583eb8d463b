"""How a Spyre model is compiled: one set-up for decoders and encoders.

Every Spyre model runs as ``torch.compile`` graphs of the configured
backend (``sendnn`` on the card, ``eager`` or ``inductor`` on the CPU).
``compile_graphs`` makes that set-up in one place:

* dynamo's cache limits are raised so that every graph warm-up compiles
  is kept (two or more per warm-up shape);
* ``sendnn`` is registered by importing ``torch_sendnn``;
* on the CPU backends dynamo guards on the inputs only: the model's
  modules and weights never change once loaded, and checking them before
  every step costs time on every step;
* ``inductor`` emits a C++ wrapper (a decode step calls ~300 small
  kernels; it trades compile time per shape for step time) and, when
  asked, freezes the weights into the graphs, which lets it fold and
  pre-pack them for oneDNN/MKL.

What each choice costs and saves, measured, is in docs/performance.md
("Costs behind the design").

The result is a ``spyre_compiled_graphs.DynamoGraphs`` (each graph compiled
at its first call) or, with a graph cache entry, a ``PrecompiledGraphs``
(each graph loaded from the cache or precompiled and kept there).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from vllm.compilation.spyre_compiled_graphs import (DynamoGraphs,
                                                    PrecompiledGraphs)
from vllm.compilation.spyre_graph_cache import GraphCache


def compile_graphs(
    model: nn.Module,
    backend: str,
    *,
    cache_size_limit: int,
    freeze: bool = False,
    cache: Optional[GraphCache] = None,
    fullgraph: bool = False,
) -> Union[DynamoGraphs, PrecompiledGraphs]:
    """``model`` compiled for ``backend``, one graph per input shape.

    ``cache_size_limit`` is the fewest graphs dynamo must keep per code
    object; ``freeze`` (``inductor`` only) makes the weights constants of
    the graphs, which a cached graph cannot hold (the caller passes
    ``freeze=False`` with a ``cache``).  ``fullgraph``: a break in the
    graph is an error, not a split (a precompiled graph is always whole).
    """
    if freeze and cache is not None:
        raise ValueError("a cached graph cannot hold frozen weights: "
                         "compile with freeze=False or without a cache")
    if backend == "sendnn":
        import torch_sendnn  # noqa: F401  registers the backend
    dynamo = torch._dynamo.config
    dynamo.cache_size_limit = max(dynamo.cache_size_limit, cache_size_limit)
    dynamo.accumulated_cache_size_limit = max(
        dynamo.accumulated_cache_size_limit, 4 * cache_size_limit)
    options: dict = {}
    if backend != "sendnn" and cache is None:
        # Guards on the inputs (shapes, flags, the cache tensors) stay and
        # pick the graph.  A precompiled graph keeps its own guards.
        options["guard_filter_fn"] = \
            torch.compiler.skip_guard_on_all_nn_modules_unsafe
    if backend == "inductor":
        options.update(cpp_wrapper=True, size_asserts=False,
                       alignment_asserts=False)
        if freeze:
            options["freezing"] = True
        # A process-wide flag: dynamo must hand the parameters to inductor
        # as parameters to freeze them, and an engine built earlier in this
        # process must not leave it set for this one.
        dynamo.prepare_freezing = freeze
    if cache is not None:
        return PrecompiledGraphs(model, backend, options or None, cache)
    # dynamic=False: every warm-up shape gets graphs of its own, as on the
    # card.  Otherwise dynamo generalises the batch dimension at the second
    # batch size it sees, and the shared graph cannot use the MKL packing
    # (per batch size) of the layers left on MKL.
    return DynamoGraphs(model, backend=backend, dynamic=False,
                        fullgraph=fullgraph, options=options or None)
