"""Model-class inspection in-process on Spyre: seconds off every start.

vLLM 0.10.1.1 learns what an architecture supports (generation, pooling,
pipeline parallel, ...) by importing its model class in a fresh Python
subprocess (``registry._run_in_subprocess``), so that the process building
the config never initialises CUDA.  There is no CUDA on the Spyre
platform, and the subprocess (a new interpreter importing vLLM) costs
several times the same import in-process; with the graph cache on, it was
the largest part of a warm start (docs/performance.md, "Costs behind the
design").

``install`` is the ``vllm.general_plugins`` entry point
``spyre_model_inspection``: vLLM calls it in every process before it builds
a config.  On Spyre it has the registry run the inspection in the calling
process; the result, and the errors the registry reports, are the same.
"""
from __future__ import annotations

from typing import Callable, TypeVar

_T = TypeVar("_T")


def install() -> None:
    """Entry point of the ``vllm.general_plugins`` group (idempotent)."""
    from vllm.config.spyre import is_spyre
    if not is_spyre():
        return
    from vllm.model_executor.models import registry
    registry._run_in_subprocess = run_here


def run_here(fn: Callable[[], _T]) -> _T:
    """What ``registry._run_in_subprocess(fn)`` returns, without the
    subprocess."""
    return fn()
