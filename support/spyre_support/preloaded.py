"""Python processes started from a fork server that has imported torch,
transformers and vLLM once.

A fresh interpreter spends about 9 s of CPU importing them before it does
anything; the tests and benchmarks start dozens of processes that each
build one engine (a graph-cache start, a benchmark script, a benchmark's
child).  ``run`` and ``context`` start them as forks of a server process
(Python's ``forkserver``, one per calling process, started on first use)
that has done those imports and nothing else: no engine, no compiled
graph, no OpenMP thread, so each child starts as clean as a fresh
interpreter, under the environment, working directory and arguments it is
given.  What the server read from the environment at import (OpenMP's
settings, transformers' offline switches) is the caller's, except vLLM's
settings that a module bound at import (``from vllm.envs import X``),
which each child reads again from its own environment, and the API
server's routes that depend on one (``_reimport_for_settings``).
"""
from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from typing import Optional, Sequence

#: What the server imports once.
PRELOAD = ["torch", "transformers", "vllm.entrypoints.llm",
           "vllm.entrypoints.openai.api_server"]


def context():
    """The ``forkserver`` context, the server preloading ``PRELOAD`` (a
    server already running keeps its own list)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _reread_vllm_settings() -> None:
    """Module globals bound from ``vllm.envs`` at import (the API client's
    ``VLLM_RPC_TIMEOUT``) take this process's values."""
    envs = sys.modules.get("vllm.envs")
    if envs is None:
        return
    names = set(envs.environment_variables)
    for name, module in list(sys.modules.items()):
        if not name.startswith("vllm.") or module is envs:
            continue
        bound = names.intersection(getattr(module, "__dict__", {}))
        for var in bound:
            setattr(module, var, getattr(envs, var))


def _reimport_for_settings() -> None:
    """The API server adds its adapter-loading routes at import when
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is set: imported again here if this
    process sets it."""
    import importlib
    api_server = sys.modules.get("vllm.entrypoints.openai.api_server")
    if api_server is None:
        return
    envs = sys.modules["vllm.envs"]
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        importlib.reload(api_server)


def _main(argv: list[str], env: dict[str, str], cwd: str, out: str,
          err: str, new_session: bool = False) -> None:
    """Body of a child: ``python argv...`` with stdout and stderr in the
    files ``out`` and ``err`` (one file if they are the same path), in a
    session of its own if ``new_session``."""
    if new_session:
        os.setsid()
    for fd, path in ((1, out), (2, err)):
        if fd == 2 and err == out:
            os.dup2(1, 2)
            break
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    # As in a fresh interpreter, no start method is chosen yet (vLLM's API
    # server sets one under VLLM_WORKER_MULTIPROC_METHOD=forkserver).
    multiprocessing.set_start_method(None, force=True)
    _reread_vllm_settings()
    _reimport_for_settings()
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  reported like the interpreter
        traceback.print_exc()
        code = 1
    try:
        # What the program registered to run at exit (engine shutdown),
        # which a forked child would otherwise skip.
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(argv: Sequence[str], env: Optional[dict[str, str]] = None,
        cwd: Optional[str] = None,
        timeout: Optional[float] = None) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, *argv], env=env, cwd=cwd,
    capture_output=True, text=True, timeout=timeout)``, the interpreter a
    fork of the preloaded server: ``argv`` is ``["-m", module, ...]`` or
    ``[script, ...]``.  A timeout kills the child and raises
    ``subprocess.TimeoutExpired``, as ``subprocess.run`` does."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="preloaded-") as scratch:
        out, err = (os.path.join(scratch, n) for n in ("out", "err"))
        proc = context().Process(
            target=_main, args=(argv, env, cwd or os.getcwd(), out, err),
            name=" ".join(argv[:2]))
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join()

        def read(path: str) -> str:
            if not os.path.exists(path):
                return ""
            with open(path, errors="replace") as f:
                return f.read()

        stdout, stderr = read(out), read(err)
    cmd = [sys.executable, *argv]
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
    return subprocess.CompletedProcess(cmd, proc.exitcode, stdout, stderr)


class Popen:
    """A long-running ``python argv...`` forked from the preloaded server,
    with ``subprocess.Popen``'s ``pid``, ``poll``, ``wait`` and
    ``returncode``; stdout and stderr both go to the file ``log``."""

    def __init__(self, argv: Sequence[str], env: dict[str, str], log: str,
                 new_session: bool = False) -> None:
        self.args = [sys.executable, *map(str, argv)]
        self._proc = context().Process(
            target=_main, args=(list(map(str, argv)), dict(env), os.getcwd(),
                                str(log), str(log), new_session),
            name=" ".join(map(str, argv[:2])))
        self._proc.start()
        self.pid = self._proc.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._proc.exitcode

    def poll(self) -> Optional[int]:
        return self._proc.exitcode

    def wait(self, timeout: Optional[float] = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._proc.exitcode
