"""deploy/k8s: the manifests parse, reference each other by the same names and ports, and carry a
backends.yaml that the gateway's own strict loader accepts, pointing at the Redis Service."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from gateway.cli import parse_args
from gateway.config.cluster import load_cluster
from tests.harness import ROOT

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
    args = pod["containers"][0]["args"]
    assert args[0] == "gateway"
    options = parse_args(args[1:])
    assert options.port == container_port(deployment, "http")
    assert options.grpc_port == container_port(deployment, "grpc")
    mount = pod["containers"][0]["volumeMounts"][0]
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    config_map = m[("ConfigMap", volume["configMap"]["name"])]
    assert options.backends.parent == Path(mount["mountPath"])
    path = tmp_path / options.backends.name
    path.write_text(config_map["data"][options.backends.name])
    config = load_cluster(path)    # the gateway's own strict validation
    redis_url = urlparse(config.settings.redis.url)
    redis_service = m[("Service", redis_url.hostname)]
    redis_port = next(p for p in redis_service["spec"]["ports"] if p["port"] == redis_url.port)
    assert container_port(m[("Deployment", redis_url.hostname)], redis_port["targetPort"]) == 6379
    grace = pod["terminationGracePeriodSeconds"]
    assert grace > config.settings.drain_timeout_s
