"""SpyreExternalLauncherExecutor: one engine per ``torchrun`` rank.

A job launched with ``torchrun --nproc-per-node N`` (a trainer, an
evaluation loop) builds ``LLM(model, tensor_parallel_size=N,
distributed_executor_backend="external_launcher")`` on every rank.  No
process of ours is started: each rank's engine runs its one worker in its
own process, the ranks form the tensor-parallel group from torchrun's
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``; gloo), and, since every engine schedules the same requests
the same way (vLLM requires a seed for this backend), every rank returns
the same outputs.  vLLM's ``ExecutorWithExternalLauncher`` does the start;
the Spyre mixin checks the cards and sets each rank's card.  With ``N=1``
plain ``python`` works too: the variables default to a one-process group.
"""
from __future__ import annotations

import os

from vllm.executor.spyre_executor import SpyreExecutorMixin
from vllm.executor.uniproc_executor import ExecutorWithExternalLauncher
from vllm.logger import init_logger
from vllm.utils import get_open_port

logger = init_logger(__name__)


class SpyreExternalLauncherExecutor(SpyreExecutorMixin,
                                    ExecutorWithExternalLauncher):
    """This process's rank of a tensor-parallel group started by torchrun."""

    uses_ray: bool = False

    def _init_executor(self) -> None:
        world = self.parallel_config.world_size
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != world:
            raise ValueError(
                f"distributed_executor_backend='external_launcher' with "
                f"tensor_parallel_size={world}, but the launcher started "
                f"WORLD_SIZE={launched} process(es); run `torchrun "
                f"--nproc-per-node {world}` (or plain python for one).")
        self._check_devices()
        if "RANK" not in os.environ:
            # One process, not launched by torchrun.
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(get_open_port()))
        rank = int(os.environ["RANK"])
        devices = self.spyre_config.devices
        if devices:
            os.environ["SPYRE_DEVICE"] = devices[rank]
        logger.info("Spyre: rank %d of %d under an external launcher", rank,
                    world)
        super()._init_executor()
