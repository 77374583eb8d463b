"""``vllm serve`` whose engine process is a fork of its API server.

vLLM's API server starts the process that holds the engine
(``MQLLMEngine``) with the ``spawn`` start method: a fresh interpreter
that imports torch and vLLM again, about 6 s of a 2-core machine before it
reads its configuration.  The API server that ``Server`` starts is itself
a fork of the preloaded server (``spyre_support.preloaded``) and has
imported all of that, so here its engine process is a fork of it: the
same function with the same arguments, started without the imports.
What a spawned engine process decides at import from the environment the
API server has set by then (``prometheus_client``'s multiprocess mode,
through which the engine's metrics reach ``/metrics``) is decided again
in the fork.  Only
that one process start changes (the engine's own ranks start as the
engine decides); ``Server(..., fork_engine=False)`` runs the plain
``vllm serve``, as the README's commands do.

    python -m spyre_support.forked_serve serve MODEL [vllm serve options]
"""
from __future__ import annotations

import multiprocessing
import os
import sys


class _ForkForSpawn:
    """The ``multiprocessing`` module as the API server sees it: a
    ``spawn`` context asked for is a ``fork`` one."""

    def __getattr__(self, name: str):
        return getattr(multiprocessing, name)

    @staticmethod
    def get_context(method=None):
        return multiprocessing.get_context(
            "fork" if method == "spawn" else method)


def _as_if_imported_here() -> None:
    """In a forked child: what prometheus_client chose at import, chosen
    under the environment of now (``PROMETHEUS_MULTIPROC_DIR``, set by the
    API server just before it starts the engine process)."""
    from prometheus_client import values
    values.ValueClass = values.get_value_class()


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main
    from vllm.entrypoints.openai import api_server
    api_server.multiprocessing = _ForkForSpawn()
    os.register_at_fork(after_in_child=_as_if_imported_here)
    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
