"""RaySpyreExecutor: tensor parallelism over Spyre cards on several machines.

The same ``MultiprocessingExecutor`` flow and Spyre hooks as the one-machine
executor, but ranks 1..N-1 run as Ray actors, each holding one unit of the
Ray resource ``spyre`` (one card).  Start Ray on every machine with its card
count, e.g. ``ray start --head --resources '{"spyre": 4}'`` and
``ray start --address HEAD:6379 --resources '{"spyre": 4}'``, then run the
server on the head machine with ``--distributed-executor-backend ray``.
Where no cluster is running, the executor starts a local Ray instance that
declares this machine's cards, and stops it at shutdown.

vLLM's own Ray executor cannot be used: it asks Ray for the accelerator ids
of its device resource, and Ray knows no Spyre accelerator.
"""
from __future__ import annotations

from typing import Any

from vllm.executor.spyre_multiproc_executor_base import (
    MultiprocessingExecutor)
from vllm.executor.spyre_executor import SpyreExecutorMixin
from vllm.logger import init_logger
from vllm.utils import get_distributed_init_method, get_ip, get_open_port

logger = init_logger(__name__)

RAY_CARD_RESOURCE = "spyre"


class _RayFuture:

    def __init__(self, ref) -> None:
        self.ref = ref

    def get(self) -> Any:
        import ray
        return ray.get(self.ref)


class _RayRank:
    """One Ray actor, with the task interface of a worker process."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def execute_method(self, method, *args, **kwargs) -> _RayFuture:
        return _RayFuture(
            self.actor.execute_method.remote(method, *args, **kwargs))

    async def execute_method_async(self, method, *args, **kwargs):
        return await self.actor.execute_method.remote(method, *args,
                                                      **kwargs)


class RaySpyreExecutor(SpyreExecutorMixin, MultiprocessingExecutor):
    """Several Spyre cards, possibly on several machines, through Ray."""

    uses_ray: bool = True
    #: True when this executor started the local Ray instance it uses.
    _started_ray: bool = False

    def _distributed_init_method(self) -> str:
        # Other machines must reach the driver: not loopback.
        return get_distributed_init_method(get_ip(), get_open_port())

    def _start_workers(self, world_size: int) -> list:
        import ray

        from vllm.executor.ray_utils import RayWorkerWrapper
        if not ray.is_initialized():
            self._join_or_start_ray(ray, world_size)
        have = ray.cluster_resources().get(RAY_CARD_RESOURCE, 0)
        if have < world_size - 1:
            raise ValueError(
                f"{world_size} ranks need {world_size - 1} Spyre cards in "
                f"the Ray cluster besides the driver's, but it declares "
                f"{have:g} units of the '{RAY_CARD_RESOURCE}' resource; "
                f"start Ray with --resources '{{\"{RAY_CARD_RESOURCE}\": "
                "N}' on each machine.")
        self._ray = ray
        actor_cls = ray.remote(num_cpus=0)(RayWorkerWrapper)
        self._actors = [
            actor_cls.options(
                resources={RAY_CARD_RESOURCE: 1},
                runtime_env={"env_vars": self._rank_env(rank)},
            ).remote(vllm_config=self.vllm_config, rpc_rank=rank)
            for rank in range(1, world_size)
        ]
        return [_RayRank(actor) for actor in self._actors]

    def _join_or_start_ray(self, ray, world_size: int) -> None:
        """Joins the Ray cluster this machine belongs to; where nobody ran
        ``ray start``, starts a local instance declaring this machine's
        cards (the environment's card count, else one per rank), as vLLM
        starts a local Ray instance when it finds no cluster."""
        try:
            ray.init(address="auto")
            return
        except ConnectionError:
            pass
        cards = self.spyre_config.card_count or world_size
        logger.info(
            "No running Ray cluster found: starting a local Ray instance "
            "with %d Spyre card(s) (resource '%s'). Run `ray start` to use "
            "cards on several machines.", cards, RAY_CARD_RESOURCE)
        ray.init(resources={RAY_CARD_RESOURCE: cards},
                 include_dashboard=False)
        self._started_ray = True

    def _rank_env(self, rank: int) -> dict[str, str]:
        env = super()._rank_env(rank)
        if rank > 0:
            # Address and port of the driver's machine, not loopback.
            env["MASTER_ADDR"] = get_ip()
        return env

    def check_health(self) -> None:
        import ray
        try:
            ray.get([a.get_node_ip.remote() for a in self._actors],
                    timeout=30)
        except Exception as exc:
            raise RuntimeError(
                f"RaySpyreExecutor: a worker actor is gone: {exc}") from exc

    def shutdown(self) -> None:
        actors, self._actors = getattr(self, "_actors", []), []
        if actors:
            for actor in actors:
                self._ray.kill(actor)
        if self._started_ray:
            self._started_ray = False
            self._ray.shutdown()
