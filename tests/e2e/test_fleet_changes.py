"""The fleet changed at runtime on a real gateway with managed simulated engines: a backend added over
the admin API serves, a drain under load loses no request and stops the engine, invalid changes are
refused whole with the fleet untouched, and SIGHUP applies the file's `backends:` again."""

from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import yaml

from testkit.harness import Gateway, free_port, long_request_id, run_gateway, write_config
from tests.e2e.test_external_engines import spawn, stop

MODEL = "llava-1.5-7b"


def engine(backend_id: str, gpu: str = "H100", role: str = "language") -> dict[str, Any]:
    return {"id": backend_id, "role": role, "gpu": gpu, "launch": {"time_scale": 0.2}}


def cluster(tmp: Path, *backends: dict[str, Any]) -> Path:
    return write_config(tmp, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "drain_timeout_s": 60},
                              "backends": list(backends)})


def ids(gw: Gateway) -> list[str]:
    return [b["id"] for b in gw.backends()]


def chat(gw: Gateway, request_id: str, max_tokens: int = 8) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens}
    return httpx.post(f"{gw.url}/v1/chat/completions", json=body, headers={"x-request-id": request_id}, timeout=60)


def admin(gw: Gateway, method: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, f"{gw.url}/admin/backends{path}", json=body, headers=gw.admin_headers, timeout=10)


class Load:
    """Closed-loop clients sending long requests until stopped; every status and serving backend kept."""

    def __init__(self, gw: Gateway, clients: int) -> None:
        self.outcomes: list[tuple[int, str]] = []
        self._stop = threading.Event()
        rid = long_request_id(60)
        self._threads = [threading.Thread(target=self._run, args=(gw, rid), daemon=True) for _ in range(clients)]
        for t in self._threads:
            t.start()

    def _run(self, gw: Gateway, rid: str) -> None:
        while not self._stop.is_set():
            r = chat(gw, rid, max_tokens=60)
            self.outcomes.append((r.status_code, r.headers.get("x-heterogate-backend", "")))

    def stop(self) -> list[tuple[int, str]]:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=90)
        return self.outcomes


def test_add_serves_drain_under_load_loses_nothing_and_invalid_changes_are_refused(tmp_path: Path) -> None:
    with run_gateway(cluster(tmp_path, engine("h100-0"), engine("a100-0", "A100-80GB"))) as gw:
        added = admin(gw, "POST", "", engine("l40s-9", "L40S"))
        assert added.status_code == 201, added.text
        assert added.json()["id"] == "l40s-9" and added.json()["managed"] is True
        gw.wait_until(lambda: gw.backend("l40s-9")["healthy"], timeout=30)

        load = Load(gw, clients=8)
        gw.wait_until(lambda: gw.backend("h100-0")["in_flight"] > 0, timeout=20)
        for backend_id in ("h100-0", "a100-0"):
            drained = admin(gw, "POST", f"/{backend_id}/drain")
            assert drained.status_code == 202, drained.text
            assert drained.json()["draining"] is True
        gw.wait_until(lambda: all(gw.backend(b)["state"] == "stopped" for b in ("h100-0", "a100-0")), timeout=60)
        assert [gw.backend(b)["pid"] for b in ("h100-0", "a100-0")] == [None, None]   # no process any more
        served_while_draining = len(load.outcomes)
        gw.wait_until(lambda: len(load.outcomes) >= served_while_draining + 8, timeout=60)
        outcomes = load.stop()
        assert outcomes and all(status == 200 for status, _ in outcomes), outcomes
        assert {backend for _, backend in outcomes} >= {"h100-0", "l40s-9"}
        # after the drain every request goes to the added engine
        assert {chat(gw, f"after-{i}").headers["x-heterogate-backend"] for i in range(5)} == {"l40s-9"}
        last_serving = admin(gw, "POST", "/l40s-9/drain")     # would leave no language backend serving
        assert last_serving.status_code == 409 and "language" in last_serving.json()["error"]["message"]
        assert last_serving.json()["error"]["type"] == "invalid_request_error"
        assert last_serving.json()["error"]["code"] == "fleet_conflict"
        assert gw.backend("l40s-9")["draining"] is False

        before = gw.backends()
        refused = {
            "unknown GPU": (engine("x-1", "NO-SUCH-GPU"), 400, "backend x-1: gpu: unknown GPU 'NO-SUCH-GPU'"),
            "id in use": (engine("l40s-9", "L40S"), 409, "already in the fleet"),
            "bad field": ({**engine("x-2"), "weight": 3}, 400, "weight"),
            "neither launch nor address": ({"id": "x-3", "gpu": "H100"}, 400, "launch"),
            "openai vision": ({"id": "x-4", "kind": "openai", "role": "vision", "gpu": "H100",
                               "address": "http://127.0.0.1:9"}, 400, "language"),
            "not an object": ([1, 2], 400, "JSON object"),
            "a command to run, with no admin key": ({"id": "x-5", "kind": "openai", "gpu": "L40S",
                                                      "launch": {"command": "true {port}"}}, 403, "admin key"),
        }
        for why, (body, status, words) in refused.items():
            r = admin(gw, "POST", "", body)
            assert r.status_code == status, (why, r.text)
            assert words in r.json()["error"]["message"], (why, r.text)
            assert r.json()["error"]["type"] == ("permission_error" if status == 403 else "invalid_request_error")
        bad_json = httpx.post(f"{gw.url}/admin/backends", content=b"{", timeout=10)
        assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
        assert admin(gw, "POST", "/nope/drain").status_code == 404
        assert admin(gw, "DELETE", "/nope").status_code == 404
        assert [b["id"] for b in gw.backends()] == [b["id"] for b in before]

        # removing: out of the list once drained; the last language backend cannot go
        assert admin(gw, "DELETE", "/h100-0").status_code == 202
        assert admin(gw, "DELETE", "/a100-0").status_code == 202
        gw.wait_until(lambda: ids(gw) == ["l40s-9"], timeout=30)
        last = admin(gw, "DELETE", "/l40s-9")
        assert last.status_code == 409 and "language" in last.json()["error"]["message"]
        assert chat(gw, "still").status_code == 200
        # the stopped engines ended the gateway's session streams themselves: no error, no traceback
        assert "Exception not handled" not in gw.log_path.read_text()


def test_an_added_openai_engine_the_gateway_launches_starts_serves_and_is_removed(tmp_path: Path) -> None:
    """`kind: openai` with `launch.command`, added over the API with an admin key: the command runs, the
    backend turns healthy and serves, and one DELETE stops the engine and takes it out."""
    (tmp_path / "admin.keys").write_text("sk-admin\n")
    (tmp_path / "cluster.token").write_text("cluster-secret\n")
    config = write_config(tmp_path, {"model": MODEL, "gateway": {
        "heartbeat_interval_ms": 100, "auth": {"admin_keys_file": str(tmp_path / "admin.keys"),
                                                "cluster_token_file": str(tmp_path / "cluster.token")}},
        "backends": [engine("h100-0")]})
    command = [sys.executable, "-m", "tests.fake_openai_server", "--port", "{port}", "--engine", "vllm"]
    with run_gateway(config, admin_key="sk-admin") as gw:
        port = int(gw.url.rsplit(":", 1)[1])
        # what could never serve is refused whole: a program that is not there, the gateway's own port or door
        refused = {
            "no such program": ({"command": ["/nonexistent/vllm", "{port}"]}, "not an executable program"),
            "the gateway's port": ({"command": command, "port": port}, "one of this gateway's own ports"),
        }
        for why, (launch, words) in refused.items():
            r = admin(gw, "POST", "", {"id": "bad-0", "kind": "openai", "gpu": "L40S", "launch": launch})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (why, r.text)
        itself = admin(gw, "POST", "", {"id": "bad-1", "kind": "openai", "gpu": "L40S",
                                         "address": f"http://localhost:{port}"})
        assert itself.status_code == 400 and "own HTTP door" in itself.json()["error"]["message"], itself.text
        assert ids(gw) == ["h100-0"]
        added = admin(gw, "POST", "", {"id": "vllm-0", "kind": "openai", "gpu": "L40S",
                                        "launch": {"command": command, "probe_interval_s": 0.1}})
        assert added.status_code == 201, added.text
        gw.wait_until(lambda: gw.backend("vllm-0")["state"] == "healthy", timeout=60)
        pid = gw.backend("vllm-0")["pid"]   # not in its metrics: the process the gateway runs for it
        assert pid and b"tests.fake_openai_server" in Path(f"/proc/{pid}/cmdline").read_bytes(), pid
        assert admin(gw, "POST", "/h100-0/drain").status_code == 202
        served = httpx.post(f"{gw.url}/v1/chat/completions", headers=gw.admin_headers, timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})
        assert served.status_code == 200 and served.headers["x-heterogate-backend"] == "vllm-0", served.text
        assert admin(gw, "DELETE", "/vllm-0").status_code == 409   # the last language backend serving
        # a port another engine holds (its probe would answer for the new one): refused as start-up refuses it
        busy = gw.backend("vllm-0")["address"].rsplit(":", 1)[1]
        twice = admin(gw, "POST", "", {"id": "vllm-1", "kind": "openai", "gpu": "L40S",
                                        "launch": {"command": command, "port": int(busy)}})
        assert twice.status_code == 400 and f"launch.port {busy} is taken twice" in twice.text, twice.text
        # one that has not started serving is no reason to let the last serving one go
        never = [sys.executable, "-c", "import sys, time; time.sleep(60)", "{port}"]
        assert admin(gw, "POST", "", {"id": "slow-0", "kind": "openai", "gpu": "L40S",
                                       "launch": {"command": never}}).status_code == 201
        not_yet = admin(gw, "DELETE", "/vllm-0")
        assert not_yet.status_code == 409 and "slow-0 not serving yet" in not_yet.text, not_yet.text
        assert admin(gw, "DELETE", "/slow-0").status_code == 202
        assert admin(gw, "POST", "", engine("h100-1")).status_code == 201
        gw.wait_until(lambda: gw.backend("h100-1")["healthy"], timeout=30)
        assert admin(gw, "DELETE", "/vllm-0").status_code == 202
        gw.wait_until(lambda: "vllm-0" not in ids(gw), timeout=30)
        log = gw.log_path.read_text()
    assert "Task exception was never retrieved" not in log and "Traceback" not in log


def test_sighup_applies_the_files_backends_and_refuses_an_invalid_file(tmp_path: Path) -> None:
    """Also: with its last encoder gone /ready says the vision pool is degraded, and a drained backend still
    in the file serves again after a reload."""
    path = cluster(tmp_path, engine("h100-0"), engine("a100-0", "A100-80GB"), engine("l4-v", "L4", "vision"))
    with run_gateway(path, healthy=3) as gw:
        assert "degraded" not in httpx.get(f"{gw.url}/ready", timeout=5).json()
        data = yaml.safe_load(path.read_text())
        data["backends"] = [engine("a100-0", "A100-80GB"), engine("l40s-0", "L40S")]
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: ids(gw) == ["a100-0", "l40s-0"] and gw.backend("l40s-0")["healthy"], timeout=60)
        assert chat(gw, "reloaded").status_code == 200
        assert httpx.get(f"{gw.url}/ready", timeout=5).json() == {
            "ready": True, "healthy_language_backends": 2, "healthy_vision_backends": 0, "degraded": ["vision"]}

        data["backends"].append(engine("x-0", "NO-SUCH-GPU"))
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: "config_reload_refused" in gw.log_path.read_text(), timeout=20)
        assert "NO-SUCH-GPU" in gw.log_tail(50)
        assert ids(gw) == ["a100-0", "l40s-0"]
        assert chat(gw, "unchanged").status_code == 200

        assert admin(gw, "POST", "/a100-0/drain").status_code == 202
        gw.wait_until(lambda: gw.backend("a100-0")["state"] == "stopped", timeout=30)
        data["backends"].pop()                                 # the valid file again
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: not gw.backend("a100-0")["draining"] and gw.backend("a100-0")["healthy"], timeout=60)
        assert ids(gw) == ["l40s-0", "a100-0"] or ids(gw) == ["a100-0", "l40s-0"]
        served = {chat(gw, f"restored-{i}").headers["x-heterogate-backend"] for i in range(12)}
        assert "a100-0" in served


def test_sighup_that_changes_the_only_backend_replaces_it(tmp_path: Path) -> None:
    """The one language backend changed in the file: drained, then added again as the file says. The
    removal's fleet without it was refused as a file (no backend for language work), which killed the
    reload with the backend gone from the table: nothing served until a restart."""
    path = cluster(tmp_path, engine("only-0"))
    with run_gateway(path) as gw:
        data = yaml.safe_load(path.read_text())
        data["backends"] = [engine("only-0", "A100-80GB")]
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: ids(gw) == ["only-0"] and gw.backend("only-0")["gpu"] == "A100-80GB"
                      and gw.backend("only-0")["healthy"], timeout=60)
        assert chat(gw, "replaced").status_code == 200
        assert "Task exception was never retrieved" not in gw.log_path.read_text()


def test_sighup_that_changes_every_language_backend_replaces_them_one_at_a_time(tmp_path: Path) -> None:
    """Both language backends changed in the file: replaced at once, nothing served until the first was
    back (503 no_backend_available for seconds); now one at a time, the other serving, and no request fails."""
    path = cluster(tmp_path, engine("h100-0"), engine("h100-1"))
    with run_gateway(path) as gw:
        load = Load(gw, clients=4)
        gw.wait_until(lambda: len(load.outcomes) >= 8, timeout=30)
        data = yaml.safe_load(path.read_text())
        data["backends"] = [engine("h100-0", "A100-80GB"), engine("h100-1", "A100-80GB")]
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: all(b["gpu"] == "A100-80GB" and b["healthy"] for b in gw.backends()), timeout=90)
        outcomes = load.stop()
    assert outcomes and all(status == 200 for status, _ in outcomes), [o for o in outcomes if o[0] != 200]


def test_an_engine_stopped_with_requests_in_flight_ends_them_and_they_restart(tmp_path: Path) -> None:
    """A drain that runs out of time stops the engine with requests still on it: its session ends each with
    UNAVAILABLE (no error logged by the gRPC server), and a request that wants one answer starts over on
    another backend."""
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "drain_timeout_s": 1},
                                     "backends": [{**engine("h100-0"), "launch": {"time_scale": 5.0}},
                                                  engine("a100-0", "A100-80GB")]})   # h100-0's answers take seconds
    with run_gateway(config) as gw:
        load = Load(gw, clients=6)
        gw.wait_until(lambda: gw.backend("h100-0")["in_flight"] > 0, timeout=20)
        assert admin(gw, "POST", "/h100-0/drain").status_code == 202
        gw.wait_until(lambda: gw.backend("h100-0")["state"] == "stopped", timeout=30)
        outcomes = load.stop()
        log = gw.log_path.read_text()
    assert outcomes and all(status == 200 for status, _ in outcomes), outcomes
    assert "the engine is stopping" in log and "restarting_after_midstream_failure" in log
    assert "Exception not handled" not in log


def test_a_stream_cut_by_a_drain_that_ran_out_of_time_says_so(tmp_path: Path) -> None:
    """A streamed answer under way on a backend whose drain runs out of time ends with an error event that
    names the drain (code backend_drained), not a backend failure, then [DONE]."""
    config = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "drain_timeout_s": 1},
                                     "backends": [{**engine("h100-0"), "launch": {"time_scale": 5.0}}]})
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 200, "stream": True}
    with run_gateway(config) as gw, httpx.stream(
            "POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60,
            headers={"x-request-id": long_request_id(200)}) as resp:
        lines = resp.iter_lines()
        assert resp.headers["x-heterogate-backend"] == "h100-0"
        assert next(line for line in lines if line.startswith("data: "))   # under way
        assert admin(gw, "POST", "", engine("a100-0", "A100-80GB")).status_code == 201
        gw.wait_until(lambda: gw.backend("a100-0")["healthy"], timeout=30)
        assert admin(gw, "POST", "/h100-0/drain").status_code == 202
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "backend_drained" and "drained" in error["message"], error


def test_a_backend_removed_after_its_drain_ran_out_of_time_gets_a_drain_of_its_own(tmp_path: Path) -> None:
    """An external backend's drain that runs out of time leaves its streams running (it is not leaving);
    a DELETE after it gives them the drain time again and then ends them with backend_drained. It used
    to cut them at once, as a backend failure."""
    port = free_port()
    upstream = spawn("tests.fake_openai_server", "--port", str(port), "--engine", "vllm", "--token-delay-ms", "100")
    try:
        config = write_config(tmp_path, {
            "model": MODEL, "gateway": {"heartbeat_interval_ms": 100, "drain_timeout_s": 1},
            "backends": [{"id": "up-0", "kind": "openai", "gpu": "L40S", "address": f"http://127.0.0.1:{port}"}]})
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 300, "stream": True}
        with run_gateway(config, healthy=0, timeout=60) as gw:   # no metrics: it counts as healthy when it answers
            gw.wait_until(lambda: httpx.get(f"{gw.url}/ready", timeout=5).status_code == 200, timeout=30)
            _stream_cut_by_removal(gw, body)
    finally:
        stop(upstream)


def _stream_cut_by_removal(gw: Gateway, body: dict[str, Any]) -> None:
    with httpx.stream("POST", f"{gw.url}/v1/chat/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))   # under way
        assert admin(gw, "POST", "", engine("h100-0")).status_code == 201
        gw.wait_until(lambda: gw.backend("h100-0")["healthy"], timeout=30)
        assert admin(gw, "POST", "/up-0/drain").status_code == 202
        gw.wait_until(lambda: "backend_drain_timeout" in gw.log_path.read_text(), timeout=10)
        assert admin(gw, "DELETE", "/up-0").status_code == 202
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "backend_drained", error
    gw.wait_until(lambda: "up-0" not in ids(gw), timeout=10)
    # the cut request is logged after the backend left: counted, but its series do not come back
    metrics = gw.wait_until(lambda: m if 'status="502"} 1.0' in (m := httpx.get(f"{gw.url}/metrics", timeout=5).text)
                            else None, timeout=10)
    assert 'backend="up-0"' not in metrics, [line for line in metrics.splitlines() if 'backend="up-0"' in line]
    assert any(line.startswith('heterogate_requests_total{backend="(removed)"') and 'status="502"' in line
               for line in metrics.splitlines())
