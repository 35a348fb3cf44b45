"""Fleet changes on a real gateway are applied one at a time, each against the fleet as the previous one
left it: a second SIGHUP while a reload replaces a backend reads the file again after that reload (it used
to apply the same replacement twice, launching a second engine under the id that the gateway refused for
good), an admin call during a reload is applied after it (a DELETE used to be swallowed by the replacement
under way and the backend came back), and with replicas a reload of an unchanged file is a quiet no-op
(it used to log `config_reload_refused`, an error)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import yaml

from testkit.harness import Gateway, run_gateway, write_config
from tests.e2e.test_fleet_changes import MODEL, Load, admin, cluster, engine, ids
from tests.replicas.redis_helpers import SYSTEM_REDIS, redis_prefix
from tests.replicas.test_replica_processes import engine_processes


def events(gw: Gateway, name: str) -> list[dict[str, Any]]:
    """The gateway's log lines of one event, in order."""
    lines = (json.loads(line) for line in gw.log_path.read_text().splitlines() if line.startswith("{"))
    return [line for line in lines if line.get("event") == name]


def draining(gw: Gateway, backend_id: str) -> bool:
    return any(b["id"] == backend_id and b["draining"] for b in gw.backends())


def slow_cluster(tmp: Path) -> Path:
    """h100-0 and l40s-0, answering slowly enough that a drain of h100-0 under load lasts a while (about a
    second per request), so a change made once it is seen draining comes during the reload."""
    return cluster(tmp, *({**e, "launch": {"time_scale": 3.0}} for e in (engine("h100-0"), engine("l40s-0", "L40S"))))


def replace_while_busy(gw: Gateway, path: Path, backend_id: str, gpu: str) -> Load:
    """Put load on `backend_id`, move it to `gpu` in the file and send SIGHUP; returns once the reload is
    under way (the old backend drains the requests it holds), with the load still running."""
    load = Load(gw, clients=6)
    try:
        gw.wait_until(lambda: gw.backend(backend_id)["in_flight"] > 0, timeout=30)
        data = yaml.safe_load(path.read_text())
        data["backends"] = [{**b, "gpu": gpu} if b["id"] == backend_id else b for b in data["backends"]]
        path.write_text(yaml.safe_dump(data))
        gw.process.send_signal(signal.SIGHUP)
        gw.wait_until(lambda: draining(gw, backend_id), timeout=20)
    except BaseException:
        load.stop()
        raise
    return load


def test_a_second_sighup_during_a_reload_reads_the_file_after_it(tmp_path: Path) -> None:
    """The second reload finds the replacement made: nothing to change, one engine for the id."""
    path = slow_cluster(tmp_path)
    with run_gateway(path, "--log-level", "info") as gw:
        load = replace_while_busy(gw, path, "h100-0", "A100-80GB")
        gw.process.send_signal(signal.SIGHUP)   # while the first reload waits for h100-0's requests
        gw.wait_until(lambda: len(events(gw, "config_reload") + events(gw, "config_reload_unchanged")) == 2,
                      timeout=60)   # both reloads have read the file
        outcomes = load.stop()
        gw.wait_until(lambda: gw.backend("h100-0")["healthy"], timeout=30)
        assert [e["replaced"] for e in events(gw, "config_reload")] == [["h100-0"]]
        assert events(gw, "config_reload_unchanged")[0]["level"] == "info"
        assert gw.backend("h100-0")["gpu"] == "A100-80GB"
        assert len(engine_processes({gw.grpc_port})["h100-0"]) == 1
    assert outcomes and all(status == 200 for status, _ in outcomes), outcomes


def test_an_admin_call_during_a_reload_is_applied_after_it(tmp_path: Path) -> None:
    """A DELETE of the backend a reload is replacing removes the replacement, rather than vanishing in it."""
    path = slow_cluster(tmp_path)
    with run_gateway(path, "--log-level", "info") as gw:
        load = replace_while_busy(gw, path, "h100-0", "A100-80GB")
        removed = admin(gw, "DELETE", "/h100-0")   # answered once the reload is through
        outcomes = load.stop()
        assert removed.status_code == 202, removed.text
        gw.wait_until(lambda: ids(gw) == ["l40s-0"], timeout=60)
        assert [e["backend"] for e in events(gw, "backend_added")] == ["h100-0"]   # the replacement, once
    assert outcomes and all(status == 200 for status, _ in outcomes), outcomes


def test_with_replicas_a_sighup_on_an_unchanged_file_is_a_quiet_no_op(tmp_path: Path) -> None:
    """A change is still refused there, as an error naming why."""
    with redis_prefix("fleet-reload") as prefix:
        path = write_config(tmp_path, {"model": MODEL, "gateway": {"heartbeat_interval_ms": 100,
                                                                   "heartbeat_miss_limit": 20,
                                                                   "redis": {"key_prefix": prefix}},
                                       "backends": [engine("l40s-0", "L40S")]})
        with run_gateway(path, "--redis-url", SYSTEM_REDIS, "--log-level", "info") as gw:
            gw.process.send_signal(signal.SIGHUP)
            gw.wait_until(lambda: events(gw, "config_reload_unchanged"), timeout=20)
            assert events(gw, "config_reload_unchanged")[0]["level"] == "info"
            assert not events(gw, "config_reload_refused")

            data = yaml.safe_load(path.read_text())
            data["backends"].append(engine("h100-0"))
            path.write_text(yaml.safe_dump(data))
            gw.process.send_signal(signal.SIGHUP)
            refused = gw.wait_until(lambda: events(gw, "config_reload_refused"), timeout=20)
            assert refused[0]["level"] == "error" and "--redis-url" in refused[0]["error"]
            assert ids(gw) == ["l40s-0"]
