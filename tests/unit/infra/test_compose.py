"""docker-compose.yml, checked without a Docker engine: the Compose Specification schema, the service
graph, health checks, images, and the settings each service is given."""

from __future__ import annotations

import json
import re
from importlib.resources import files
from typing import Any

import jsonschema
import pytest
import yaml

CONDITIONS = {"service_started", "service_healthy", "service_completed_successfully"}
USES_DATABASE = {"catalog", "api"}
REQUIRED_FIELDS = {
    "nats_url",
    "nats_nkey_file",
    "s3_endpoint",
    "s3_key_file",
    "s3_bucket",
    "redis_url",
    "http_host",
    "http_port",
}


def one_shots(compose: dict[str, Any]) -> set[str]:
    """Services others wait on to finish (migrations, bucket creation)."""
    return {
        target
        for svc in compose["services"].values()
        for target, dep in (svc.get("depends_on") or {}).items()
        if isinstance(dep, dict) and dep.get("condition") == "service_completed_successfully"
    }


def test_matches_the_compose_specification_schema(compose: dict[str, Any]) -> None:
    schema = json.loads(
        files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    validator = jsonschema.Draft202012Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, "\n".join(errors)


def test_has_backends_migration_and_every_service(compose: dict[str, Any], services: tuple[str, ...]) -> None:
    expected = {"nats", "minio", "redis", "postgres", "migrate", *services}
    assert expected <= set(compose["services"])


def test_depends_on_names_existing_services_with_a_condition(compose: dict[str, Any]) -> None:
    names = set(compose["services"])
    for name, svc in compose["services"].items():
        depends_on = svc.get("depends_on") or {}
        assert isinstance(depends_on, dict), f"{name}: depends_on must be the long form with conditions"
        for target, dep in depends_on.items():
            assert target in names, f"{name} depends on unknown service {target}"
            assert dep.get("condition") in CONDITIONS, f"{name} -> {target}: condition missing or unknown"
            if dep["condition"] == "service_healthy":
                assert "healthcheck" in compose["services"][target], (
                    f"{name} waits for {target} to be healthy"
                )


def test_long_running_services_have_health_checks_and_one_shots_do_not_restart(
    compose: dict[str, Any],
) -> None:
    shots = one_shots(compose)
    assert {"migrate"} <= shots
    for name, svc in compose["services"].items():
        if name in shots:
            assert svc.get("restart") == "no", f"one-shot {name} must not restart"
        else:
            test = svc.get("healthcheck", {}).get("test")
            assert test, f"{name} has no health check"


def test_database_users_wait_for_migrations(compose: dict[str, Any]) -> None:
    migrate = compose["services"]["migrate"]
    assert migrate["command"][:3] == ["python", "-m", "crucible.db"]
    assert migrate["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in USES_DATABASE:
        assert (
            compose["services"][name]["depends_on"]["migrate"]["condition"]
            == "service_completed_successfully"
        )


def test_nats_runs_jetstream_config_and_health_checks_its_monitoring_port(
    compose: dict[str, Any], repo
) -> None:
    nats = compose["services"]["nats"]
    mounts = {
        m.split(":")[1]: m.split(":")[0] for m in nats["volumes"] if isinstance(m, str) and m.startswith("./")
    }
    config_path = nats["command"][nats["command"].index("--config") + 1]
    assert (repo / mounts[config_path]).is_file()
    config = (repo / mounts[config_path]).read_text()
    assert re.search(r"^jetstream\s*\{", config, re.MULTILINE)
    monitor_port = re.search(r"^http_port:\s*(\d+)", config, re.MULTILINE).group(1)
    assert f"127.0.0.1:{monitor_port}/healthz" in " ".join(nats["healthcheck"]["test"])


@pytest.mark.parametrize(
    "service", ["catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api"]
)
def test_service_builds_its_own_dockerfile(compose: dict[str, Any], repo, service: str) -> None:
    build = compose["services"][service]["build"]
    assert build["dockerfile"] == f"infra/docker/{service}.Dockerfile"
    assert (repo / build.get("context", ".") / build["dockerfile"]).is_file()


def test_every_build_names_an_existing_dockerfile(compose: dict[str, Any], repo) -> None:
    for name, svc in compose["services"].items():
        if "build" in svc:
            assert (repo / svc["build"].get("context", ".") / svc["build"]["dockerfile"]).is_file(), name


@pytest.mark.parametrize(
    "service", ["catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api"]
)
def test_service_settings_match_what_compose_passes(
    compose: dict[str, Any], settings_from_env, interpolate, service: str
) -> None:
    svc = compose["services"][service]
    env = svc["environment"]
    settings = settings_from_env(service, env)
    passed = {k.removeprefix("CRUCIBLE_").lower() for k in env if k.startswith("CRUCIBLE_")}
    required = REQUIRED_FIELDS | ({"database_url"} if service in USES_DATABASE else set())
    assert required <= passed, f"{service} is not given {sorted(required - passed)}"
    assert settings.nats_url == "nats://nats:4222"
    assert settings.s3_endpoint.split(":")[0] == "minio"
    assert settings.redis_url.startswith("redis://redis:")
    if service in USES_DATABASE:
        assert (
            settings.database_url.startswith("postgresql+asyncpg://")
            and "@postgres:5432/" in settings.database_url
        )
    health = " ".join(svc["healthcheck"]["test"])
    assert f"127.0.0.1:{settings.http_port}/readyz" in health
    assert settings.http_host == "0.0.0.0", "health checks and Prometheus reach the service from outside"


def test_api_publishes_its_rest_port_on_loopback(compose: dict[str, Any], settings_from_env) -> None:
    api = compose["services"]["api"]
    settings = settings_from_env("api", api["environment"])
    assert f"127.0.0.1:{settings.api_port}:{settings.api_port}" in api["ports"]
    assert settings.api_host == "0.0.0.0"


def test_published_ports_bind_loopback_only(compose: dict[str, Any]) -> None:
    for name, svc in compose["services"].items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), f"{name} publishes {port} on every interface"


def test_minio_init_makes_each_service_a_user_with_its_own_key_and_policy(
    compose: dict[str, Any], services
) -> None:
    """The bucket is made with MinIO's root key; then each service gets a user of its own, its S3 key and
    its policy from the identities volume (`crucible identities`), which is what the service mounts."""
    from crucible.contracts.access import OBJECT_GRANTS

    init = compose["services"]["minio-init"]
    minio_env = compose["services"]["minio"]["environment"]
    assert init["environment"]["MINIO_ROOT_USER"] == minio_env["MINIO_ROOT_USER"]
    assert init["environment"]["MINIO_ROOT_PASSWORD"] == minio_env["MINIO_ROOT_PASSWORD"]
    script = init["command"][0]
    bucket = compose["services"]["api"]["environment"]["CRUCIBLE_S3_BUCKET"]
    assert f"mc mb --ignore-existing crucible/{bucket}" in script
    loop = re.search(r"for s in ([a-z ]+); do", script)
    assert loop and set(loop.group(1).split()) == set(OBJECT_GRANTS) == set(services)
    for step in (
        '"/identities/$$s/s3.key"',
        '"/identities/server/minio/$$s.json"',
        "mc admin user add",
        "mc admin policy attach",
    ):
        assert step in script, step
    assert "identities:/identities:ro" in init["volumes"]
    assert init["depends_on"]["identities"]["condition"] == "service_completed_successfully"
    for service in services:
        assert (
            compose["services"][service]["environment"]["CRUCIBLE_S3_KEY_FILE"]
            == "/run/crucible/identity/s3.key"
        )
        assert (
            compose["services"][service]["depends_on"]["minio-init"]["condition"]
            == "service_completed_successfully"
        )


def test_database_url_matches_postgres_credentials(compose: dict[str, Any], interpolate) -> None:
    pg = {k: interpolate(v) for k, v in compose["services"]["postgres"]["environment"].items()}
    url = interpolate(compose["services"]["api"]["environment"]["CRUCIBLE_DATABASE_URL"])
    credentials = f"{pg['POSTGRES_USER']}:{pg['POSTGRES_PASSWORD']}"
    assert url == f"postgresql+asyncpg://{credentials}@postgres:5432/{pg['POSTGRES_DB']}"


def identity_mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    """(target, subpath) of each read-only mount of the identities volume."""
    return [
        (m["target"], m["volume"]["subpath"])
        for m in svc.get("volumes", [])
        if isinstance(m, dict) and m.get("source") == "identities" and m.get("read_only")
    ]


@pytest.mark.parametrize(
    "service", ["catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api"]
)
def test_each_service_mounts_its_own_bus_identity_and_no_other(compose: dict[str, Any], service: str) -> None:
    svc = compose["services"][service]
    assert identity_mounts(svc) == [("/run/crucible/identity", service)]
    assert svc["environment"]["CRUCIBLE_NATS_NKEY_FILE"] == "/run/crucible/identity/seed.nk"
    assert svc["depends_on"]["bus-setup"]["condition"] == "service_completed_successfully"


def test_nats_admits_only_the_bus_identities_and_sees_no_seed(compose: dict[str, Any], repo) -> None:
    services = compose["services"]
    assert services["identities"]["command"][:2] == ["crucible", "identities"]
    assert identity_mounts(services["nats"]) == [("/etc/nats/bus", "server")]
    assert services["nats"]["depends_on"]["identities"]["condition"] == "service_completed_successfully"
    assert 'include "bus/auth.conf"' in (repo / "infra" / "nats" / "nats.conf").read_text()
    assert identity_mounts(services["bus-setup"]) == [("/run/crucible/identity", "admin")]
    assert services["bus-setup"]["command"] == ["crucible", "bus", "setup"]


SECRET_NAME = re.compile(r"(PASSWORD|SECRET|ACCESS_KEY|TOKEN)", re.IGNORECASE)
REQUIRED = re.compile(r"\$\{[A-Z_][A-Z0-9_]*:\?[^}]*\}")


def test_compose_holds_no_credential_literal(compose: dict[str, Any], repo) -> None:
    """Every secret a service is given comes from the operator's .env, with no default to fall back on:
    compose refuses to start without it (the bus identities are generated at first start)."""
    for name, svc in compose["services"].items():
        env = svc.get("environment") or {}
        for key, value in env.items():
            if SECRET_NAME.search(key):
                assert REQUIRED.fullmatch(str(value)), f"{name}: {key} is {value!r}, not a required variable"
        url = env.get("CRUCIBLE_DATABASE_URL")
        if url:
            password = url.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
            assert REQUIRED.fullmatch(password), f"{name}: the database URL carries a password literal"
    assert not re.search(
        r":-[^}]*(secret|password)", (repo / "docker-compose.yml").read_text(), re.IGNORECASE
    )


def test_the_tls_override_turns_tls_on_for_every_client_and_both_servers(
    compose: dict[str, Any], repo
) -> None:
    """docker-compose.tls.yml, as `docker compose -f docker-compose.yml -f docker-compose.tls.yml` merges
    it: a valid compose file naming only services of the base, every Crucible service verifying both
    servers against the CA, nats-server and MinIO serving the certificate."""
    tls = yaml.safe_load((repo / "docker-compose.tls.yml").read_text())
    schema = json.loads(
        files("check_jsonschema.builtin_schemas.vendor").joinpath("compose-spec.json").read_text()
    )
    assert not list(jsonschema.Draft202012Validator(schema).iter_errors(tls))
    assert set(tls["services"]) <= set(compose["services"])
    clients = {"bus-setup", "catalog", "sandbox", "rollout", "grader", "trainer", "checkpoints", "api"}
    for name in clients:
        env = tls["services"][name]["environment"]
        assert env["CRUCIBLE_NATS_URL"].startswith("tls://") and env["CRUCIBLE_S3_SECURE"] == "true"
        (mount,) = tls["services"][name]["volumes"]
        assert env["CRUCIBLE_NATS_TLS_CA_FILE"] == env["CRUCIBLE_S3_CA_FILE"] == f"{mount['target']}/ca.pem"
    assert {"--tls", "--tlscert", "--tlskey"} <= set(tls["services"]["nats"]["command"])
    assert "--certs-dir" in tls["services"]["minio"]["command"]
    assert tls["services"]["minio-init"]["environment"]["MINIO_URL"] == "https://minio:9000"
