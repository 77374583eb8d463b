"""A real ``vllm serve`` process on loopback, for the online tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """Starts ``vllm serve MODEL`` under ``env`` and waits until healthy."""

    def __init__(self, model: Path, env: dict, args: tuple = (),
                 log_path: Optional[Path] = None):
        self.model = str(model)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or Path(f"/tmp/vllm-serve-{self.port}.log")
        full_env = dict(os.environ, **env)
        full_env.setdefault("VLLM_USE_V1", "0")
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.cli.main", "serve",
            self.model, "--host", "127.0.0.1", "--port",
            str(self.port), *args
        ]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.proc.returncode}:\n"
                    + self.log()[-4000:])
            try:
                if requests.get(self.url + "/health", timeout=2).ok:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not healthy in {timeout} s:\n"
                           + self.log()[-4000:])

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> "Server":
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
