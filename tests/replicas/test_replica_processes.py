"""Gateway replicas as real processes on one Redis: a replica killed with SIGKILL, Redis restarted
under load, the leader killed under load (its engines adopted, not relaunched), every replica killed
(the engines exit by themselves), and `--workers`.

Each test gets its own key prefix (system Redis) or its own `redis-server` (the restart test).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from common.control_credentials import ENV_ENGINE_IDENTITY, IDENTITY_METADATA
from common.wire import control_pb2, control_pb2_grpc
from gateway.replicas.workers import WORKER_ENV
from testkit.harness import ROOT, Gateway, free_port, long_request_id, metric_total, run_gateway, write_config
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix, redis_server

pytestmark = pytest.mark.timeout(120)
MODEL = "llava-1.5-7b"


def cluster(tmp: Path, name: str, prefix: str, *, time_scale: float = 0.2, **redis: Any) -> Path:
    """Two managed language engines (H100, L40S); each replica gets its own directory (and log)."""
    d = tmp / name
    d.mkdir()
    launch = {"time_scale": time_scale}
    return write_config(d, {
        "model": MODEL,
        "gateway": {"heartbeat_interval_ms": 100, "redis": {"key_prefix": prefix, **redis}},
        "backends": [{"id": "h100-0", "gpu": "H100", "launch": launch},
                     {"id": "l40s-0", "gpu": "L40S", "launch": launch}],
    })


@contextmanager
def replicas(tmp: Path, prefix: str, url: str, n: int, **kw: Any) -> Iterator[list[Gateway]]:
    """`n` replicas started one after another (the first takes the leader lease and runs the engines)."""
    with ExitStack() as stack:
        yield [stack.enter_context(run_gateway(cluster(tmp, f"r{i}", prefix, **kw), "--redis-url", url, healthy=2))
               for i in range(n)]


def engine_processes(control_ports: set[int]) -> dict[str, list[int]]:
    """backend id -> pids of the engine processes pointed at one of these gateways' control ports
    (`--gateway` lists the replicas' shared engines' port first, then the launching replica's own)."""
    out: dict[str, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "backends.engine" not in argv or "--gateway" not in argv or "gateway.control.process_guard" in argv:
            continue   # not an engine (a guard's command line carries its engine's too)
        ports = {int(a.rsplit(":", 1)[1]) for a in argv[argv.index("--gateway") + 1].split(",")}
        if ports & control_ports:
            out.setdefault(argv[argv.index("--backend-id") + 1], []).append(int(entry))
    return out


def stat(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: [state, ppid, ...]."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def test_a_killed_replicas_in_flight_counts_vanish_from_the_others_view_after_its_ttl(tmp_path: Path) -> None:
    with redis_prefix("kill9") as prefix, \
            replicas(tmp_path, prefix, SYSTEM_REDIS, 2, time_scale=5.0, replica_ttl_ms=300) as (a, b):
        stop = threading.Event()

        def stream(i: int) -> None:
            body = {"model": MODEL, "prompt": "count", "max_tokens": 300, "stream": True}
            try:
                with httpx.stream("POST", f"{b.url}/v1/completions", json=body, timeout=30,
                                  headers={"x-request-id": long_request_id(200, prefix=f"k{i}")}) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass   # the replica is killed under it

        pool = ThreadPoolExecutor(4)
        for i in range(4):
            pool.submit(stream, i)
        try:
            a.wait_until(lambda: metric_total(a, "heterogate_backend_peer_in_flight") >= 4, timeout=20)
            b.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            a.wait_until(lambda: metric_total(a, "heterogate_backend_peer_in_flight") == 0, timeout=10, interval=0.02)
            vanished_s = time.monotonic() - killed
        finally:
            stop.set()
            pool.shutdown(wait=True)
        print(f"peer in-flight counts gone {vanished_s:.3f} s after SIGKILL (replica_ttl_ms 300, refresh 50 ms)")
        assert vanished_s <= 3.0   # a TTL of 0.3 s: ~0.35 s here, bounded loosely for a loaded machine
        assert metric_total(a, "heterogate_shared_state_peers") == 0


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary to restart Redis")
def test_redis_restarted_under_load_fails_no_request_and_sharing_resumes(tmp_path: Path) -> None:
    with redis_server() as (url, port, proc), replicas(tmp_path, "hgtest:restart:", url, 2) as (a, b):
        b.wait_until(lambda: metric_total(b, "heterogate_shared_state_peers") == 1, timeout=10)
        with load(a, b, a, b) as (results, stop_load):
            time.sleep(1.0)
            proc.kill()
            proc.wait()
            for gw in (a, b):
                gw.wait_until(lambda gw=gw: metric_total(gw, "heterogate_shared_state_up") == 0, timeout=10)
            during = len(results)
            time.sleep(1.5)   # Redis away for longer than the heartbeats' miss limit
            with redis_server(port) as (_, _, again):
                for gw in (a, b):
                    gw.wait_until(lambda gw=gw: metric_total(gw, "heterogate_shared_state_up") == 1, timeout=15)
                b.wait_until(lambda: metric_total(b, "heterogate_shared_state_peers") == 1, timeout=10)
                time.sleep(0.5)
                stop_load()
                served_without_redis = len(results) - during
                assert again.poll() is None
        failures = [r for r in results if r != 200]
        print(f"{len(results)} requests, {served_without_redis} sent while Redis was away, failures: {failures[:5]}")
        assert served_without_redis > 0
        assert failures == []
        for gw in (a, b):
            assert metric_total(gw, "heterogate_shared_state_errors_total") > 0
            assert "shared_state_down" in gw.log_path.read_text()


@contextmanager
def load(*gws: Gateway) -> Iterator[tuple[list[int | str], Callable[[], None]]]:
    """One closed-loop client on each of `gws` until the block ends or the function given with their
    answers (status code or error) is called."""
    results: list[int | str] = []
    stop = threading.Event()

    def run(gw: Gateway) -> None:
        with gw.client(timeout=30) as c:
            while not stop.is_set():
                try:
                    results.append(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4})
                                   .status_code)
                except httpx.HTTPError as exc:
                    results.append(repr(exc))

    def stopped() -> None:
        stop.set()
        for t in threads:
            t.join()

    threads = [threading.Thread(target=run, args=(gw,)) for gw in gws]
    for t in threads:
        t.start()
    try:
        yield results, stopped
    finally:
        stopped()


def gone(pids: list[int], timeout_s: float) -> bool:
    """Every one of `pids` has exited (or is a zombie) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() and stat(p)[0] not in ("Z", "X") for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_leader_killed_under_load_the_survivor_keeps_serving_and_adopts_the_engines(tmp_path: Path) -> None:
    """Two replicas, the leader killed with SIGKILL while 4 clients send to the other: no request
    fails, the engines are the same processes throughout (never two for one backend), and the
    survivor supervises them from then on: one killed is relaunched by it, and its SIGTERM stops both."""
    lease_ms = 1500
    with redis_prefix("adopt") as prefix, ExitStack() as stack:
        a, b = (stack.enter_context(run_gateway(cluster(tmp_path, f"r{i}", prefix, leader_lease_ms=lease_ms),
                                                "--redis-url", SYSTEM_REDIS, "--log-level", "info", healthy=2))
                for i in range(2))
        ports = {a.grpc_port, b.grpc_port}
        before = engine_processes(ports)
        assert sorted(before) == ["h100-0", "l40s-0"] and all(len(p) == 1 for p in before.values())
        most = [1]
        watching = threading.Event()

        def watch() -> None:
            while not watching.is_set():
                most[0] = max([most[0], *(len(p) for p in engine_processes(ports).values())])
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with load(b, b, b, b) as (results, _):
                time.sleep(0.5)
                a.process.send_signal(signal.SIGKILL)
                b.wait_until(lambda: b.log_path.read_text().count("engine_adopted") == 2, timeout=30)
                time.sleep(0.5)
        finally:
            watching.set()
            watcher.join()
        failures = [r for r in results if r != 200]
        print(f"leader SIGKILLed under load: {len(results)} requests to the survivor, failures: {failures[:5]}")
        assert failures == [] and len(results) > 0
        assert most[0] == 1, "two engine processes for one backend at once"
        assert engine_processes(ports) == before
        # the survivor supervises them now: a killed engine is relaunched by it, under its own guard
        old_h100, l40s = before["h100-0"][0], before["l40s-0"][0]
        os.kill(old_h100, signal.SIGKILL)
        new = b.wait_until(lambda: (x := b.backend("h100-0"))["healthy"] and x["pid"] not in (old_h100, None)
                           and x, timeout=30)
        assert int(stat(int(stat(new["pid"])[1]))[1]) == b.process.pid
        assert engine_processes(ports) == {"h100-0": [new["pid"]], "l40s-0": [l40s]}
        for r in (c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
                  for c in [stack.enter_context(b.client())] for _ in range(10)):
            assert r.status_code == 200, r.text
    assert gone([new["pid"], l40s], timeout_s=20), "the survivor's SIGTERM left an engine running"


def test_leader_stopped_under_load_hands_its_engines_to_the_other_replica(tmp_path: Path) -> None:
    """A rolling restart: the leader's SIGTERM stopped the engines every replica routes to (the other
    replica's requests failed while it launched them again); now it leaves them running and frees the
    lease, the other replica adopts them, and no request fails."""
    with redis_prefix("handover") as prefix, ExitStack() as stack:
        a, b = (stack.enter_context(run_gateway(cluster(tmp_path, f"r{i}", prefix, leader_lease_ms=1500),
                                                "--redis-url", SYSTEM_REDIS, "--log-level", "info", healthy=2))
                for i in range(2))
        ports = {a.grpc_port, b.grpc_port}
        before = engine_processes(ports)
        assert sorted(before) == ["h100-0", "l40s-0"]
        with load(b, b, b, b) as (results, _):
            time.sleep(0.5)
            a.process.send_signal(signal.SIGTERM)
            assert a.process.wait(timeout=60) == 0
            b.wait_until(lambda: b.log_path.read_text().count("engine_adopted") == 2, timeout=30)
            time.sleep(0.5)
        failures = [r for r in results if r != 200]
        print(f"leader SIGTERMed under load: {len(results)} requests to the other replica, failures: {failures[:5]}")
        assert failures == [] and len(results) > 0
        assert "engines_handed_over" in a.log_path.read_text()
        assert engine_processes(ports) == before, "the engines were stopped and launched again"


def test_engines_that_no_replica_hears_exit_by_themselves(tmp_path: Path) -> None:
    with redis_prefix("orphans") as prefix, \
            replicas(tmp_path, prefix, SYSTEM_REDIS, 2, leader_lease_ms=1500, engine_orphan_s=2) as (a, b):
        engines = engine_processes({a.grpc_port, b.grpc_port})
        assert len(engines) == 2
        for gw in (a, b):
            gw.process.send_signal(signal.SIGKILL)
            gw.process.wait()
    assert gone([p for pids in engines.values() for p in pids], timeout_s=20)


def by_worker(gw: Gateway, name: str) -> tuple[str, float]:
    """(the replica id of the worker that answered, its sum of the samples called `name`), from one
    /metrics read (a new connection: the kernel picks the worker)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = [s for f in text_string_to_metric_families(httpx.get(f"{gw.url}/metrics", timeout=5).text)
               for s in f.samples]
    replica = next(s.labels["replica"] for s in samples if s.name == "heterogate_shared_state_up")
    return replica, sum(s.value for s in samples if s.name == name)


def worker_requests(gw: Gateway) -> tuple[str, float]:
    return by_worker(gw, "heterogate_requests_total")


def engine_identity(pid: int) -> str:
    """The identity a gateway gave the engine `pid` (its environment, readable by the same user)."""
    env = dict(v.split("=", 1) for v in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in v)
    return env[ENV_ENGINE_IDENTITY]


def heartbeats_admitted(grpc_port: int, backend_id: str, address: str, identity: str, streams: int) -> list[str]:
    """One stale heartbeat (seq 1: the state table ignores it) on each of `streams` new connections to the
    workers' shared control port; the answer of each: "ack" or the gRPC status code's name."""
    out = []
    for _ in range(streams):
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            call = control_pb2_grpc.ControlStub(channel).Connect(
                iter([control_pb2.BackendState(backend_id=backend_id, address=address, seq=1)]),
                metadata=((IDENTITY_METADATA, identity),), timeout=10)
            try:
                out.extend("ack" for _ in call)
            except grpc.RpcError as exc:
                out.append(exc.code().name)
    return out


def test_workers_with_managed_engines_any_worker_admits_them_and_the_next_leader_keeps_it(tmp_path: Path) -> None:
    """`--workers 2` launching its own engines. Engines heartbeat to the shared control port, so each
    stream lands on whichever worker the kernel picks; every worker must admit the launcher's engines
    (the leader announces their identity digests through Redis) and still refuse a wrong identity.
    The leader worker killed, its engines run on, adopted by the next leader with their identities;
    one of them killed is relaunched with the new leader's. 16 streams on new connections all land on
    one worker with probability 2^-15."""
    with redis_prefix("wmanaged") as prefix:
        config = cluster(tmp_path, "w", prefix, leader_lease_ms=1500)
        with run_gateway(config, "--workers", "2", "--redis-url", SYSTEM_REDIS, healthy=0) as gw:

            def both_workers_see(pids: set[int] | None) -> dict[str, list[int]] | None:
                try:
                    healthy = dict(by_worker(gw, "heterogate_backend_healthy") for _ in range(16))
                except httpx.HTTPError:   # a connection queued on the killed worker's socket is reset
                    return None
                engines = engine_processes({gw.grpc_port})
                fresh = pids is None or not pids & {p for ps in engines.values() for p in ps}
                ok = len(healthy) == 2 and set(healthy.values()) == {2.0} and len(engines) == 2 and fresh
                return engines if ok else None

            def check(engines: dict[str, list[int]], refused_identity: str) -> None:
                addresses = {b["id"]: b["address"] for b in gw.backends()}
                for backend_id, pids in engines.items():
                    assert len(pids) == 1, engines
                    identity = engine_identity(pids[0])
                    admitted = heartbeats_admitted(gw.grpc_port, backend_id, addresses[backend_id], identity, 16)
                    assert admitted == ["ack"] * 16, admitted
                    for wrong in (refused_identity, identity + "x", ""):
                        assert heartbeats_admitted(gw.grpc_port, backend_id, addresses[backend_id], wrong, 4) == \
                            ["PERMISSION_DENIED"] * 4
                for _ in range(40):   # a new connection each time
                    r = httpx.post(f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                                   timeout=10)
                    assert r.status_code == 200, r.text

            before = gw.wait_until(lambda: both_workers_see(None), timeout=60, interval=0.2)
            served_before = dict(worker_requests(gw) for _ in range(16))
            check(before, "guess")
            served = dict(worker_requests(gw) for _ in range(30))
            assert len(served) == 2 and all(served[w] > served_before.get(w, 0) for w in served), served
            # the leader worker (its engines' process guards are its children) is killed; the parent
            # restarts it, the engines run on and the other worker takes the lease and adopts them
            guard = int(stat(before["h100-0"][0])[1])
            leader = int(stat(guard)[1])
            old_identity = engine_identity(before["h100-0"][0])
            os.kill(leader, signal.SIGKILL)
            gw.wait_until(lambda: not Path(f"/proc/{leader}").exists() or stat(leader)[0] in ("Z", "X"), timeout=10)
            after = gw.wait_until(lambda: both_workers_see(None), timeout=60, interval=0.2)
            assert after == before and engine_identity(after["h100-0"][0]) == old_identity
            check(after, "guess")
            # a killed engine is relaunched by the new leader, with its own identity for that engine
            os.kill(after["h100-0"][0], signal.SIGKILL)
            again = gw.wait_until(lambda: both_workers_see(set(after["h100-0"])), timeout=60, interval=0.2)
            assert int(stat(int(stat(again["h100-0"][0])[1]))[1]) != leader
            check(again, old_identity)
        # the workers stop together: the leader hands its engines to no other worker, it stops them
        assert gone([p for pids in again.values() for p in pids], timeout_s=5), "engines outlived the workers"


def test_workers_share_ports_and_state(tmp_path: Path) -> None:
    """Two workers in front of an OpenAI-compatible engine."""
    port = free_port()
    engine = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "mock_openai_engine.py"), "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:   # the engine answers before the gateway starts
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "mock engine did not start"
                time.sleep(0.1)
        with redis_prefix("workers") as prefix:
            d = tmp_path / "w"
            d.mkdir()
            config = write_config(d, {
                "model": MODEL, "served_model_name": "mock", "gateway": {"redis": {"key_prefix": prefix}},
                "backends": [{"id": "up0", "kind": "openai", "gpu": "H100", "address": f"http://127.0.0.1:{port}"}],
            })
            with run_gateway(config, "--workers", "2", "--redis-url", SYSTEM_REDIS, healthy=0) as gw:
                gw.wait_until(lambda: all(metric_total(gw, "heterogate_shared_state_peers") == 1 for _ in range(10)),
                              timeout=30)
                for _ in range(40):   # a new connection each time: the kernel picks a worker for each
                    r = httpx.post(f"{gw.url}/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2},
                                   timeout=10)
                    assert r.status_code == 200, r.text
                served = dict(worker_requests(gw) for _ in range(30))   # by worker
                assert len(served) == 2 and sum(served.values()) == 40 and min(served.values()) > 0, served
                # a reload asked of the parent is refused, said in the log; nothing stops
                gw.process.send_signal(signal.SIGHUP)
                gw.wait_until(lambda: "config_reload_refused" in gw.log_path.read_text(), timeout=10)
                assert gw.process.poll() is None
                r = httpx.post(f"{gw.url}/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2},
                               timeout=10)
                assert r.status_code == 200, r.text
                # the parent killed outright: its workers stop too (they served on, orphaned, sharing the
                # ports with whatever gateway started next)
                pid = gw.process.pid
                workers = [int(w) for w in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
                assert len(workers) == 2, workers
                gw.process.kill()
                gw.process.wait()
                gw.wait_until(lambda: not any(running(w) for w in workers), timeout=30)
    finally:
        engine.kill()
        engine.wait()


def running(pid: int) -> bool:
    """The process exists and is no zombie (an orphan's reaper may be slow to collect it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_worker_starts_no_workers_and_no_option_is_abbreviated(tmp_path: Path) -> None:
    """`--worker 2` was read as `--workers 2` and stayed in each worker's command line (which drops only
    `--workers`): every worker started two more, without end."""
    config = cluster(tmp_path, "n", "hgtest:none:")
    base = [sys.executable, "-m", "gateway.cli", "--backends", str(config), "--redis-url", SYSTEM_REDIS,
            "--port", str(free_port()), "--grpc-port", str(free_port())]
    short = subprocess.run([*base, "--worker", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert short.returncode == 2 and "unrecognized arguments: --worker 2" in short.stderr, short.stderr
    nested = subprocess.run([*base, "--workers", "2"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                            env={**os.environ, WORKER_ENV: "1"})
    assert nested.returncode == 2 and "a worker starts no workers of its own" in nested.stderr, nested.stderr


def test_workers_without_redis_is_a_start_up_error(tmp_path: Path) -> None:
    config = cluster(tmp_path, "n", "hgtest:none:")
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "--backends", str(config), "--workers", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    assert "--workers 2 needs Redis" in run.stderr
