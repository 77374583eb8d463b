"""MultiprocessingExecutor: one worker process per rank, on one machine.

A device-agnostic base for tensor-parallel executors.  The driver worker
(rank 0) runs in the engine's own process; ranks 1..N-1 run in worker
processes started with vLLM's ``ProcessWorkerWrapper`` (task queue in, result
queue out) and watched by vLLM's ``WorkerMonitor``, which tears everything
down if one of them dies (``RankMonitor`` first records and logs which rank
died, so the engine's error and ``check_health`` can name it).  Each engine
step runs on the driver; the other ranks follow it in
``start_worker_execution_loop``, receiving the step's inputs through the
tensor-parallel group's broadcast.

How ranks are started is one more hook, ``_start_workers``; the Ray
variant (``vllm.executor.spyre_ray_executor``) starts Ray actors instead.

Device specifics go through four hooks that a device mixin overrides:

* ``_check_devices()``: refuse to start on a bad device configuration;
* ``_rank_env(rank)``: environment variables of one rank, applied before
  its process starts (and to the engine process while rank 0 starts);
* ``_worker_kwargs(rank, init_method)``: the worker constructor's
  arguments;
* ``_distributed_init_method()``: where the ranks meet;
* ``_rank_preload()``: the modules a rank imports before its worker
  exists, which the fork server the ranks start from imports once.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, Optional, Union

from vllm import envs
from vllm.executor.executor_base import DistributedExecutorBase
from vllm.executor.multiproc_worker_utils import (ProcessWorkerWrapper,
                                                  ResultHandler,
                                                  WorkerMonitor)
from vllm.logger import init_logger
from vllm.utils import (get_distributed_init_method, get_open_port,
                        make_async, run_method)
from vllm.worker.worker_base import WorkerWrapperBase

logger = init_logger(__name__)

#: How long a failed collective waits for a rank's death to show.
_DEATH_GRACE_S = 2.0


class MultiprocessingExecutor(DistributedExecutorBase):
    """Tensor parallelism over local worker processes, any device."""

    uses_ray: bool = False

    # ---- hooks for device mixins ----------------------------------------
    def _check_devices(self) -> None:
        """Raise if the machine cannot run ``world_size`` ranks."""

    def _rank_env(self, rank: int) -> dict[str, str]:
        """Environment variables of one rank."""
        return {}

    def _distributed_init_method(self) -> str:
        return get_distributed_init_method("127.0.0.1", get_open_port())

    def _rank_preload(self) -> list[str]:
        return ["vllm.worker.worker_base"]

    def _worker_kwargs(self, rank: int, init_method: str) -> dict[str, Any]:
        return dict(vllm_config=self.vllm_config,
                    local_rank=rank,
                    rank=rank,
                    distributed_init_method=init_method,
                    is_driver_worker=rank == 0)

    # ---- start-up -------------------------------------------------------
    def _init_executor(self) -> None:
        self._check_devices()
        world_size = self.parallel_config.world_size
        if self.parallel_config.pipeline_parallel_size != 1:
            raise NotImplementedError(
                "Pipeline parallelism is not supported by "
                f"{type(self).__name__}")
        self.workers = self._start_workers(world_size)

        # Rank 0 runs here: its variables while it starts, the caller's
        # environment (an application's, for an in-process LLM) after.
        with rank_environ(self._rank_env(0)):
            self.driver_worker = WorkerWrapperBase(self.vllm_config,
                                                   rpc_rank=0)
            init_method = self._distributed_init_method()
            all_kwargs = [
                self._worker_kwargs(rank, init_method)
                for rank in range(world_size)
            ]
            self._run_workers("init_worker", all_kwargs)
            self._run_workers("init_device")
            self._run_workers("load_model")
        logger.info("%s: %d ranks ready", type(self).__name__, world_size)

    def _start_workers(self, world_size: int) -> list:
        """Starts ranks 1..world_size-1; returns handles whose
        ``execute_method`` gives a future with ``get()``."""
        start_method = rank_start_method(self._rank_preload())
        # vLLM's queues and worker processes take their start method from
        # the environment: set while they are made, not after.
        with rank_environ({"VLLM_WORKER_MULTIPROC_METHOD": start_method}):
            return self._start_rank_processes(world_size)

    def _start_rank_processes(self, world_size: int) -> list:
        self.result_handler = ResultHandler()
        workers = []
        for rank in range(1, world_size):
            env = dict(os.environ, **self._rank_env(rank))
            workers.append(
                ProcessWorkerWrapper(self.result_handler,
                                     RankWorkerFactory(env, os.getcwd()),
                                     self.vllm_config, rank))
            logger.info("%s: rank %d runs in process %d", type(self).__name__,
                        rank, workers[-1].process.pid)
        self.worker_monitor = RankMonitor(workers, self.result_handler,
                                          type(self).__name__)
        self.result_handler.start()
        self.worker_monitor.start()
        return workers

    # ---- execution ------------------------------------------------------
    def _driver_execute_model(self, execute_model_req):
        with self._naming_dead_ranks():
            return self.driver_worker.execute_model(execute_model_req)

    @contextlib.contextmanager
    def _naming_dead_ranks(self) -> Iterator[None]:
        """Re-raises a failure caused by a dead rank (a broken collective
        on the driver, or vLLM's ``ChildProcessError("worker died")`` on a
        pending future) as one error that names the ranks."""
        try:
            yield
        except Exception as exc:
            # A killed rank's sockets close before its process has fully
            # ended, so the driver's collective may fail first: give the
            # death a moment to show.
            grace = _DEATH_GRACE_S if isinstance(
                exc, (RuntimeError, OSError)) else 0.0
            dead = self._dead_ranks(grace)
            if dead:
                raise RuntimeError(
                    f"{type(self).__name__}: rank(s) {dead} died during an "
                    "engine step; the engine cannot continue") from exc
            raise

    def _dead_ranks(self, grace: float = 0.0) -> list[int]:
        """Ranks whose worker process died first (the monitor then stops
        the others), or else every rank whose process has ended, waiting up
        to ``grace`` seconds for one to end.  Ended means the process's
        sentinel is ready: ``is_alive()`` can answer True while the
        monitor thread is reaping the same process."""
        monitor = getattr(self, "worker_monitor", None)
        if monitor is not None and monitor.dead_ranks:
            return monitor.dead_ranks
        procs = [(rank, w.process)
                 for rank, w in enumerate(self.workers, start=1)
                 if hasattr(w, "process")]
        if not procs:
            return []
        ended = wait([p.sentinel for _, p in procs], timeout=grace)
        return [rank for rank, p in procs if p.sentinel in ended]

    def _run_workers(
        self,
        method: Union[str, Callable],
        *args,
        async_run_tensor_parallel_workers_only: bool = False,
        max_concurrent_workers: Optional[int] = None,
        **kwargs,
    ) -> Any:
        """Runs ``method`` on every rank: the other ranks first (they wait
        on the driver's collectives), then the driver; returns the results
        in rank order, or only the other ranks' futures when asked to."""
        if max_concurrent_workers:
            raise NotImplementedError("max_concurrent_workers")
        if isinstance(method, str):
            sent: Union[str, bytes] = method
        else:
            import cloudpickle
            sent = cloudpickle.dumps(method)
        futures = [w.execute_method(sent, *args, **kwargs)
                   for w in self.workers]
        if async_run_tensor_parallel_workers_only:
            return futures
        with self._naming_dead_ranks():
            driver_result = run_method(self.driver_worker, sent, args, kwargs)
            return [driver_result] + [f.get() for f in futures]

    async def _driver_execute_model_async(self, execute_model_req=None):
        return await make_async(self.driver_worker.execute_model)(
            execute_model_req)

    async def _start_worker_execution_loop(self):
        await asyncio.gather(*(
            w.execute_method_async("start_worker_execution_loop")
            for w in self.workers))

    def _wait_for_tasks_completion(self, parallel_worker_tasks: Any) -> None:
        with self._naming_dead_ranks():
            for future in parallel_worker_tasks:
                future.get()

    def check_health(self) -> None:
        if not self.worker_monitor.is_alive():
            raise RuntimeError(
                f"{type(self).__name__}: rank(s) {self._dead_ranks()} died")

    def shutdown(self) -> None:
        monitor = getattr(self, "worker_monitor", None)
        if monitor is not None:
            monitor.close()


class RankMonitor(WorkerMonitor):
    """vLLM's worker monitor, which first records which ranks (1..N-1)
    died and logs them with their exit codes, before it stops the others
    and closes the result queue."""

    def __init__(self, workers: list, result_handler: ResultHandler,
                 owner: str) -> None:
        super().__init__(workers, result_handler)
        self.owner = owner
        #: Ranks whose process exited on its own (empty until one does).
        self.dead_ranks: list[int] = []

    def run(self) -> None:
        processes = [w.process for w in self.workers]
        ended = wait([p.sentinel for p in processes])
        if not self._close:
            self.dead_ranks = [rank for rank, p in enumerate(processes, 1)
                               if p.sentinel in ended]
            for rank in self.dead_ranks:
                proc = processes[rank - 1]
                proc.join(1)
                logger.error("%s: rank %d (process %d) died with exit code "
                             "%s; stopping the other ranks", self.owner,
                             rank, proc.pid, proc.exitcode)
        super().run()


@contextlib.contextmanager
def rank_environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` while inside; each variable's earlier
    value, or its absence, restored after."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def rank_start_method(preload: list[str]) -> str:
    """How rank processes start: ``forkserver`` (a server process that
    imports ``preload`` once, the first time this process starts ranks,
    forks each rank), unless ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` asks
    for a fresh interpreter per rank.  Never a fork of the engine: its
    OpenMP threads do not survive one."""
    if envs.VLLM_WORKER_MULTIPROC_METHOD == "spawn":
        return "spawn"
    import multiprocessing
    multiprocessing.set_forkserver_preload(preload)
    return "forkserver"


class RankWorkerFactory:
    """Builds one rank's worker in its own process under the environment
    and working directory the engine gave it: a forked rank inherits the
    fork server's, not the engine's."""

    def __init__(self, env: dict[str, str], cwd: str) -> None:
        self.env = env
        self.cwd = cwd

    def __call__(self, vllm_config, rank: int) -> WorkerWrapperBase:
        os.environ.clear()
        os.environ.update(self.env)
        os.chdir(self.cwd)
        return WorkerWrapperBase(vllm_config, rpc_rank=rank)
