"""deploy/k8s: the manifests parse, reference each other by the same names and ports, and carry a
backends.yaml that the gateway's own strict loader accepts, pointing at the Redis Service; the pod's
exact arguments and environment (its Secret's token included) pass every check start-up makes
(`gateway check-config` with those arguments runs the same function as start-up)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

from common.control_credentials import ENV_CLUSTER_TOKEN
from gateway.cli import parse_args
from gateway.config.cluster import load_cluster
from testkit.harness import ROOT, run_gateway
from tests.test_check_config_parity import run_cli

K8S = ROOT / "deploy" / "k8s"


def manifests() -> dict[tuple[str, str], dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = {}
    for name in kustomization["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def container_port(deployment: dict[str, Any], name: str) -> int:
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    return next(int(p["containerPort"]) for p in container["ports"] if p["name"] == name)


def test_every_manifest_kind_is_there_and_selectors_match_their_pods() -> None:
    m = manifests()
    assert {kind for kind, _ in m} == {"Deployment", "Service", "ConfigMap"}
    for (kind, _), doc in m.items():
        if kind == "Deployment":
            labels = doc["spec"]["template"]["metadata"]["labels"]
            assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for (kind, name), doc in m.items():
        if kind == "Service":
            deployment = m[("Deployment", name)]
            assert doc["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
            for port in doc["spec"]["ports"]:
                container_port(deployment, port["targetPort"])   # a named port the pod declares
    assert m[("Deployment", "heterogate")]["spec"]["replicas"] >= 2


def test_the_gateway_pods_run_the_configmaps_file_on_the_service_ports(tmp_path: Path) -> None:
    m = manifests()
    deployment = m[("Deployment", "heterogate")]
    pod = deployment["spec"]["template"]["spec"]
    in_pod = pod["containers"][0]["args"]
    assert in_pod[0] == "gateway"
    mount = pod["containers"][0]["volumeMounts"][0]
    assert Path(in_pod[in_pod.index("--backends") + 1]).parent == Path(mount["mountPath"])   # the ConfigMap's
    args, _, _ = pod_command(tmp_path)
    options = parse_args(args[1:])
    assert options.port == container_port(deployment, "http")
    assert options.grpc_port == container_port(deployment, "grpc")
    config = load_cluster(options.backends)    # the gateway's own strict validation
    redis_url = urlparse(config.settings.redis.url)
    redis_service = m[("Service", redis_url.hostname)]
    redis_port = next(p for p in redis_service["spec"]["ports"] if p["port"] == redis_url.port)
    assert container_port(m[("Deployment", redis_url.hostname)], redis_port["targetPort"]) == 6379
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > config.settings.drain_timeout_s


def pod_command(tmp_path: Path) -> tuple[list[str], dict[str, Any], Path]:
    """The gateway container's args with the ConfigMap's file put where they name it (under tmp_path),
    and the container spec."""
    m = manifests()
    pod = m[("Deployment", "heterogate")]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mount = container["volumeMounts"][0]
    config_map = m[("ConfigMap", next(v for v in pod["volumes"] if v["name"] == mount["name"])["configMap"]["name"])]
    args = list(container["args"])
    for name, text in config_map["data"].items():
        (tmp_path / name).write_text(text)
        inside = f"{mount['mountPath']}/{name}"
        args = [str(tmp_path / name) if a == inside else a for a in args]
    return args, container, tmp_path


def container_env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: plain values, and Secret keys from `secrets`
    (a Secret that is not there leaves its variable out, as an optional reference would)."""
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            if ref["name"] in secrets:
                env[item["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def test_the_pod_passes_start_up_checks_with_its_secret(tmp_path: Path) -> None:
    """The Deployment's exact args and env, its Secret holding a token: start-up's checks say OK (the
    control port listens on 0.0.0.0, so the token is required), and warn that the door is open."""
    args, container, _ = pod_command(tmp_path)
    assert args[0] == "gateway"
    ref = next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == ENV_CLUSTER_TOKEN)
    env = container_env(container, {ref["name"]: {ref["key"]: "a-token-from-the-secret"}})
    assert env == {ENV_CLUSTER_TOKEN: "a-token-from-the-secret"}
    result = run_cli("check-config", *args[1:], env=env)
    assert result.returncode == 0, result.stderr
    assert "OK (model llava-1.5-7b, 2 backends)" in result.stdout
    assert "warning: the HTTP door listens on 0.0.0.0, beyond loopback, with no API keys" in result.stderr


def on_loopback(args: list[str]) -> list[str]:
    """The pod's options with both doors on 127.0.0.1 and the ports left to the test harness."""
    out: list[str] = []
    pairs = iter(args)
    for arg in pairs:
        if arg in ("--port", "--grpc-port", "--backends"):
            next(pairs)
        elif arg in ("--host", "--grpc-host"):
            out += [arg, "127.0.0.1"]
            next(pairs)
        else:
            out.append(arg)
    return out


def test_the_pods_gateway_process_starts(tmp_path: Path) -> None:
    """The gateway itself with the pod's options and environment, its doors on loopback and this machine's
    Redis standing in for the Redis Service (under a key prefix of its own; a replica that cannot reach
    Redis exits): it starts (the engines' hosts do not resolve here), answers its liveness probe, and its
    readiness probe says 503: no upstream answers."""
    args, container, _ = pod_command(tmp_path)
    ref = next(e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == ENV_CLUSTER_TOKEN)
    env = container_env(container, {ref["name"]: {ref["key"]: "a-token-from-the-secret"}})
    backends = Path(args[args.index("--backends") + 1])
    config = yaml.safe_load(backends.read_text())
    assert config["gateway"]["redis"]["url"] == "redis://heterogate-redis:6379/0"
    config["gateway"]["redis"] |= {"url": "redis://127.0.0.1:6379/0", "key_prefix": f"hg-test-k8s:{uuid.uuid4().hex}:"}
    backends.write_text(yaml.safe_dump(config))
    with run_gateway(backends, *on_loopback(args[1:]), healthy=0, env=env, timeout=60) as gw:
        liveness = container["livenessProbe"]["httpGet"]["path"]
        assert httpx.get(f"{gw.url}{liveness}", timeout=5).status_code == 200
        # nothing can serve here: the pod must not be ready (it said 200 with every upstream unresolvable)
        gw.wait_until(lambda: all(b.get("reachable") is False for b in gw.backends()))
        readiness = container["readinessProbe"]["httpGet"]["path"]
        assert httpx.get(f"{gw.url}{readiness}", timeout=5).status_code == 503


def test_without_its_secret_the_pod_would_not_start_and_says_what_is_missing(tmp_path: Path) -> None:
    args, container, _ = pod_command(tmp_path)
    result = run_cli("check-config", *args[1:], env=container_env(container, {}))
    assert result.returncode == 2
    assert "cluster_token_env is required" in result.stderr and ENV_CLUSTER_TOKEN in result.stderr
    assert "listens on 0.0.0.0" in result.stderr
