"""Spyre executors: how the engine starts Spyre workers.

``SpyreExecutorMixin`` holds everything Spyre-specific about starting a
worker (the hooks of ``MultiprocessingExecutor``): the device check, each
rank's environment (rendezvous address, intra-op threads, which card, FMS's
tensor-parallel setting) and the worker arguments.  ``SpyreExecutor`` is that
mixin on vLLM's single-process executor, for one card; the multi-card
``MultiprocessingSpyreExecutor`` puts the same mixin on the generic
``MultiprocessingExecutor``.

The platform picks the executor in ``check_and_update_config``: one card
(tensor parallel size 1) -> ``SpyreExecutor``; several -> the
multiprocessing one, or vLLM's Ray executor with
``--distributed-executor-backend ray``.
"""
from __future__ import annotations

import os
from typing import Optional

from vllm.config.spyre import SpyreConfig
from vllm.executor.spyre_multiproc_executor_base import rank_environ
from vllm.executor.uniproc_executor import UniProcExecutor
from vllm.logger import init_logger
from vllm.utils import get_open_port

logger = init_logger(__name__)


class SpyreExecutorMixin:
    """Spyre-specific start-up of the ranks of one engine."""

    _master_port: Optional[str] = None

    @property
    def spyre_config(self) -> SpyreConfig:
        return SpyreConfig.from_vllm_config(self.vllm_config)

    def _check_devices(self) -> None:
        """Refuses a card count the deployment cannot provide."""
        world = self.parallel_config.world_size
        devices = self.spyre_config.devices
        if devices and len(devices) < world:
            raise ValueError(
                f"{world} ranks need {world} Spyre cards, but SPYRE_DEVICES "
                f"lists {len(devices)}: {','.join(devices)}.")

    def _rank_env(self, rank: int) -> dict[str, str]:
        """Environment of one rank: the rendezvous address FMS and
        torch.distributed read (even for one rank), its share of the CPU
        cores, and its card."""
        world = self.parallel_config.world_size
        if self._master_port is None:
            self._master_port = os.environ.get("MASTER_PORT") or str(
                get_open_port())
        env = {
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": self._master_port,
            "OMP_NUM_THREADS": os.environ.get(
                "OMP_NUM_THREADS", str(threads_per_rank(world))),
        }
        devices = self.spyre_config.devices
        if devices:
            env["SPYRE_DEVICE"] = devices[rank]
        return env

    def _rank_preload(self) -> list[str]:
        """The base's modules and the Spyre workers of every mode, with all
        they import (vLLM, torch, FMS, the model code)."""
        return [*super()._rank_preload(), *SPYRE_RANK_MODULES]


class SpyreExecutor(SpyreExecutorMixin, UniProcExecutor):
    """One Spyre card, one worker, in the engine's process."""

    uses_ray: bool = False

    def _init_executor(self) -> None:
        """Starts the worker as vLLM's UniProcExecutor does, under the
        Spyre rank environment: the worker reads it while it starts (its
        threads, the rendezvous, FMS's load), and the caller's process
        gets its own environment back after."""
        world_size = self.parallel_config.world_size
        if world_size != 1:
            raise ValueError(
                f"SpyreExecutor runs one card, not {world_size}; use "
                "MultiprocessingSpyreExecutor for tensor parallelism.")
        self._check_devices()
        with rank_environ(self._rank_env(0)):
            super()._init_executor()


#: The modules a Spyre rank imports for its worker: named, not imported
#: here (executors import no worker code).
SPYRE_RANK_MODULES = ("vllm.worker.spyre_static_worker",
                      "vllm.worker.spyre_cb_worker",
                      "vllm.worker.spyre_pooling_worker")


def threads_per_rank(world_size: int) -> int:
    """Intra-op threads per rank: the usable cores shared evenly."""
    cores = len(os.sched_getaffinity(0))
    return max(1, cores // world_size)
