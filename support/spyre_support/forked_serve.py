"""``vllm serve`` whose engine process is a fork of its API server.

vLLM's API server starts the process that holds the engine
(``MQLLMEngine``) with the ``spawn`` start method: a fresh interpreter
that imports torch and vLLM again, about 6 s of a 2-core machine before it
reads its configuration.  The API server that ``Server`` starts is itself
a fork of the preloaded server (``spyre_support.preloaded``) and has
imported all of that, so here its engine process is a fork of it: the
same function with the same arguments, started without the imports.
What a spawned engine process would start afresh is reset in the fork:
``prometheus_client``'s multiprocess mode, chosen at import from the
environment the API server has set by then (through it the engine's
metrics reach ``/metrics``), and the client of a fork server (the API
server's own, under ``VLLM_WORKER_MULTIPROC_METHOD=forkserver``), so that
the engine starts its tensor-parallel ranks from a server of its own.
Only that one process start changes (the engine's own ranks start as the
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


def _as_if_spawned() -> None:
    """In a forked child: what prometheus_client chose at import, chosen
    under the environment of now (``PROMETHEUS_MULTIPROC_DIR``, set by the
    API server just before it starts the engine process); and no fork
    server known yet, as in a fresh interpreter."""
    from multiprocessing import forkserver
    from prometheus_client import values
    values.ValueClass = values.get_value_class()
    server = forkserver._forkserver
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    server._inherited_fds = None


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main
    from vllm.entrypoints.openai import api_server
    api_server.multiprocessing = _ForkForSpawn()
    os.register_at_fork(after_in_child=_as_if_spawned)
    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
