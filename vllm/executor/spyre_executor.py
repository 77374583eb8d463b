"""SpyreExecutor: runs one SpyreWorker in the engine's own process.

The engine (``LLMEngine``, or ``MQLLMEngine`` behind the OpenAI server)
creates this executor because the Spyre platform sets it as
``parallel_config.distributed_executor_backend``.  It is vLLM's single-process
executor plus the Spyre-specific environment a worker needs before it joins
the (one-rank) gloo process group.
"""
from __future__ import annotations

import os

from vllm.executor.uniproc_executor import UniProcExecutor
from vllm.logger import init_logger
from vllm.utils import get_open_port

logger = init_logger(__name__)


class SpyreExecutor(UniProcExecutor):
    """One Spyre card, one worker, in-process."""

    uses_ray: bool = False

    def _init_executor(self) -> None:
        """Sets the rendezvous variables FMS and torch.distributed read even
        for one rank, then starts the worker as vLLM's UniProcExecutor
        does."""
        world_size = self.parallel_config.world_size
        if world_size != 1:
            raise NotImplementedError(
                f"SpyreExecutor runs one card; tensor parallel size "
                f"{world_size} is not supported on Spyre yet.")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(get_open_port()))
        super()._init_executor()
