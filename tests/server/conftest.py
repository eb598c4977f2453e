"""A real `python -m megastep.server` process on 127.0.0.1 with a free port, on the tiny model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The built-in tiny model (written into the cache on first use)."""
    from megastep.builtin import builtin_model_dir

    return Path(builtin_model_dir())


class Server:
    def __init__(self, model_dir: Path | None, *args: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "megastep.server", "--port", str(self.port), *args]
        if model_dir is not None:
            cmd += ["--model", str(model_dir)]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"megastep-server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = httpx.get(self.url + "/health", timeout=1)
                if r.status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up in 120 s:\n{self.output()}")
            time.sleep(0.2)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.time() + timeout
        while True:
            m = self.metrics()
            idle = (m["megastep_running_sequences"] == 0 and m["megastep_queue_depth"] == 0
                    and m["megastep_state_pool_tokens_used"] == 0 and m["megastep_engine_live_sequences"] == 0)
            if idle or time.time() > deadline:
                return m
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    # no --model: the server's default, the built-in tiny model
    s = Server(None, "--max-seqs", "32", "--capacity", "16384", "--chunk", "16", "--queue-limit", "64")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def small_server(tiny_model_dir):
    """One sequence slot, 256 tokens of state, one waiting request allowed."""
    s = Server(tiny_model_dir, "--max-seqs", "2", "--capacity", "256", "--chunk", "16", "--queue-limit", "1")
    yield s
    s.stop()


@pytest.fixture
def start_server():
    """Start servers with any flags (`start_server(model_dir, *args)`); all stopped afterwards."""
    started: list[Server] = []

    def start(model_dir: Path | None, *args: str) -> Server:
        started.append(Server(model_dir, *args))
        return started[-1]

    yield start
    for s in started:
        s.stop()
