"""Real Redis for the replica tests: the system one on 127.0.0.1:6379 under a fresh key prefix, or a
private `redis-server` process (for restarts), and in-process replicas built on real state tables."""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager

import redis

from common.catalog import load_catalog
from gateway.config.sections import RedisConfig
from gateway.replicas.shared_state import SharedState, connect
from gateway.routing.state_table import StateTable
from testkit.harness import free_port

SYSTEM_REDIS = "redis://127.0.0.1:6379/0"


def fresh_prefix(name: str) -> str:
    return f"hgtest:{name}:{uuid.uuid4().hex[:8]}:"


@contextmanager
def redis_prefix(name: str, url: str = SYSTEM_REDIS) -> Iterator[str]:
    """A key prefix nobody else uses; every key under it is deleted afterwards."""
    prefix = fresh_prefix(name)
    try:
        yield prefix
    finally:
        with redis.Redis.from_url(url, socket_timeout=2) as r:
            keys = list(r.scan_iter(match=prefix + "*", count=1000))
            if keys:
                r.delete(*keys)


@contextmanager
def redis_server(port: int | None = None, password: str | None = None) -> (
    Iterator[tuple[str, int, subprocess.Popen[bytes]]]
):
    """A private redis-server without persistence on a free port (killed afterwards); with `password`, one
    that asks for it (the URL given is without it)."""
    binary = shutil.which("redis-server")
    assert binary is not None, "redis-server is not installed"
    port = port or free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
                             *(("--requirepass", password) if password else ())],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with redis.Redis.from_url(url, socket_timeout=0.5, password=password) as r:
                    r.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield url, port, proc
    finally:
        proc.kill()
        proc.wait()


def table(gpus: dict[str, str], interval_s: float = 0.2, clock: object = None) -> StateTable:
    """A state table of language backends `id -> GPU name` (as build_runtime registers them)."""
    cat = load_catalog()
    t = StateTable(cat.model("llava-1.5-7b"), interval_s, 3, **({"clock": clock} if clock else {}))  # type: ignore[arg-type]
    for backend_id, gpu in gpus.items():
        t.register(backend_id, "language", cat.gpu(gpu), address=None, managed=False)
    return t


@asynccontextmanager
async def replica(t: StateTable, prefix: str, name: str, url: str = SYSTEM_REDIS,
                  on_heartbeat: Callable[[str, str], None] = lambda backend_id, address: None,
                  **config: object) -> AsyncIterator[SharedState]:
    cfg = RedisConfig(url=url, key_prefix=prefix, **config)  # type: ignore[arg-type]
    client = connect(cfg, url)
    try:
        yield SharedState(t, client, cfg, name, on_heartbeat=on_heartbeat)
    finally:
        await client.aclose()
