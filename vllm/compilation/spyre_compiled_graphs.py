"""The compiled model: the callables that run a graph by its name.

``compile_graphs`` (``spyre_compile``) wraps a model in one of two:

* ``DynamoGraphs`` when the graph cache is off: ``torch.compile`` over a
  copy of the model's ``forward``; dynamo picks the graph by its guards.
* ``PrecompiledGraphs`` when it is on: one precompiled function per graph
  name (dynamo's ``aot_compile``), loaded from this rank's entry of the
  graph store (``spyre_graph_cache.GraphCache``) or compiled at its first
  call and written there, with the guards that can be saved.

The runners call either with the graph's name (a warm-up shape's prefill
or decode, continuous batching's steps) and the model's inputs.
"""
from __future__ import annotations

import types
from typing import TYPE_CHECKING, Callable, Optional

import torch

from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.compilation.spyre_graph_cache import GraphCache

logger = init_logger(__name__)


class PrecompiledGraphs:
    """The compiled model when the graph cache is on: one precompiled
    function per graph name, loaded from the cache or compiled (and
    kept) at its first call.

    A loaded graph's guards are checked against its first inputs; a graph
    whose guards fail is compiled again.  Later calls skip the check: the
    graph's name already fixes every shape it guards, and checking the
    guards of every weight costs time on every step (docs/performance.md,
    "Costs behind the design").
    """

    def __init__(self, model: torch.nn.Module, backend: str,
                 options: Optional[dict], cache: GraphCache) -> None:
        self.model = model
        self.backend = backend
        self.options = options
        self.cache = cache
        self.graphs: dict[str, Callable] = {}

    def __call__(self, graph: str, *args, **kwargs):
        fn = self.graphs.get(graph)
        if fn is not None:
            return fn(self.model, *args, **kwargs)
        # The first call too: kernels may be loaded when first run.
        with self.cache.kernels():
            fn = self._load(graph, args, kwargs)
            if fn is None:
                fn = self._compile(graph, args, kwargs)
            fn.disable_guard_check()
            self.graphs[graph] = fn
            return fn(self.model, *args, **kwargs)

    def _load(self, graph: str, args: tuple, kwargs: dict):
        payload = self.cache.read(graph)
        if payload is None:
            return None
        try:
            from torch._dynamo.aot_compile import AOTCompiledFunction
            fn = AOTCompiledFunction.deserialize(payload)
            # A saved graph does not remember which inputs were marked
            # dynamic; its shape guards (the batch range) still apply.
            args, kwargs = _unmarked((args, kwargs))
            matches = fn.guard_check(self.model, *args, **kwargs)
        except Exception as e:  # a foreign or stale artifact
            return self.cache.reject(graph, f"cannot be loaded ({e!r})")
        if not matches:
            return self.cache.reject(
                graph, "does not match the inputs it serves "
                f"({_guard_failure(fn, self.model, args, kwargs)})")
        self.cache.stats["loaded"] += 1
        return fn

    def _compile(self, graph: str, args: tuple, kwargs: dict):
        from torch._dynamo.aot_compile import AOTCompiledFunction
        options = dict(self.options or {}, guard_filter_fn=_keep_guard)
        # prepare_freezing (set by an engine without the cache earlier in
        # this process) would keep the parameters out of the saved graph's
        # inputs, and the loaded graph could not be called.
        with torch._dynamo.config.patch(enable_aot_compile=True,
                                        prepare_freezing=False):
            compiled = torch.compile(self.model.forward,
                                     backend=self.backend,
                                     fullgraph=True,
                                     dynamic=False,
                                     options=options)
            fn = compiled.aot_compile((args, kwargs))
        self.cache.stats["compiled"] += 1
        try:
            payload = AOTCompiledFunction.serialize(fn).serialized_data
        except Exception as e:
            logger.warning("Spyre graph cache: graph %s cannot be saved "
                           "(%r); it is compiled at every start", graph, e)
        else:
            self.cache.write(graph, payload)
        return fn


def _unmarked(value):
    """``value`` with every tensor marked dynamic (``mark_dynamic``)
    replaced by an unmarked alias of the same data."""
    if isinstance(value, torch.Tensor):
        if hasattr(value, "_dynamo_dynamic_indices"):
            return value.detach()
        return value
    if isinstance(value, (list, tuple)):
        return type(value)(_unmarked(v) for v in value)
    if isinstance(value, dict):
        return {k: _unmarked(v) for k, v in value.items()}
    return value


def _guard_failure(fn, model, args: tuple, kwargs: dict) -> str:
    """The first failing guard of a precompiled function, in words."""
    f_locals = fn.prepare_f_locals(model, *args, **kwargs)
    reason = fn._artifacts.guard_manager.check_verbose(f_locals)
    return "; ".join(getattr(reason, "verbose_code_parts", [str(reason)]))


def _keep_guard(entries) -> list[bool]:
    """Every guard that can be saved: not those on globals, nor the kinds
    dynamo cannot serialise, nor those on a tensor-parallel process group
    (a live object; the group is fixed by the entry's tensor parallel
    size, and vLLM creates its groups in the same order at every start)."""
    from torch._dynamo.guards import CheckFunctionManager
    from torch.distributed import ProcessGroup
    unsaved = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    groups = tuple(e.name for e in entries
                   if e.has_value and isinstance(e.value, ProcessGroup))
    return [
        not e.is_global and e.guard_type not in unsaved
        and not any(e.name == g or e.name.startswith(g + ".") for g in groups)
        for e in entries
    ]


class DynamoGraphs:
    """The compiled model when the graph cache is off: dynamo picks the
    graph by its guards, so the graph name is not needed.

    ``model.forward`` is compiled through a copy with a code object of its
    own.  Dynamo keeps its graphs per code object, and guards on a model's
    weights by shape and dtype, not identity; a graph with frozen weights
    holds one model's weights as constants.  Without the copy, a second
    model of the same class in the process (an embedder beside a reranker,
    two engines) would run the first one's graphs and weights."""

    def __init__(self, model: torch.nn.Module, **compile_args) -> None:
        self.compiled = torch.compile(own_code(model.forward),
                                      **compile_args)

    def __call__(self, graph: str, *args, **kwargs):
        return self.compiled(*args, **kwargs)


def own_code(method: Callable) -> Callable:
    """``method`` (bound) with a copy of its function's code object."""
    func = method.__func__
    copy = types.FunctionType(func.__code__.replace(), func.__globals__,
                              func.__name__, func.__defaults__,
                              func.__closure__)
    copy.__kwdefaults__ = func.__kwdefaults__
    return types.MethodType(copy, method.__self__)
