"""docker-compose.yml checked offline, and the health probe its `im` service runs.

No Docker engine runs here, so the compose file is validated with
`docker-compose config` and its commands and environments are checked
against the real code: every command of our image must be accepted by the
module it names, every environment must load as that service's
settings, and the services run as replicas must be set up for it.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.common.settings import ConfigError
from services.common.tls import make_dev_certs
from services.im.adapters.service_credentials import ensure_embedded_credentials
from services.runtime.bootstrap import LEASE_CONNECTIONS

from . import ROOT, IMProcess, im_environment, in_ci, migrate_im, python_module, running_im

COMPOSE_FILE = ROOT / "docker-compose.yml"
IM_SERVICE = "agentim.im.v1.IMService"


# -- docker-compose.yml ------------------------------------------------------


def _docker_compose(*args: str) -> subprocess.CompletedProcess[str]:
    command = shutil.which("docker-compose")
    if command is None:
        reason = "the docker-compose command is missing: `make install` installs it (as root)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return subprocess.run(
        [command, "-f", str(COMPOSE_FILE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The compose file as docker-compose resolves it (anchors merged, variables set)."""
    result = _docker_compose("config")
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert isinstance(config, dict)
    return config


def _services(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    services = config.get("services")
    assert isinstance(services, dict) and services, "no services"
    return services


def _our_image(service: dict[str, Any]) -> bool:
    return "build" in service or str(service.get("image", "")).startswith("agentim")


def _python_module_command(command: Any) -> tuple[str, list[str]]:
    """Splits `python -m MODULE ARGS...` (list form) into MODULE and ARGS."""
    assert isinstance(command, list), f"use the list form for commands of our image, got {command!r}"
    assert len(command) >= 3, f"expected python -m MODULE ..., got {command!r}"
    assert command[:2] == ["python", "-m"], f"expected python -m MODULE ..., got {command!r}"
    return command[2], [str(arg) for arg in command[3:]]


def _assert_command_accepted(command: Any) -> None:
    module, args = _python_module_command(command)
    assert importlib.util.find_spec(module) is not None, f"no module {module}"
    # argparse checks positionals (subcommand choices, HOST:PORT...) before
    # it acts on a later --help, so exit 0 means the arguments are accepted.
    result = subprocess.run(
        python_module(module, *args, "--help"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"{command!r} is refused by {module}:\n{result.stderr}"


def _settings_class(module: str) -> Any:
    """The `Settings` of the service package a module belongs to (`services.im.config`), if any."""
    parts = module.split(".")
    package = ".".join(parts[:2]) if parts[0] == "services" else parts[0]
    if importlib.util.find_spec(f"{package}.config") is None:
        return None
    return getattr(importlib.import_module(f"{package}.config"), "Settings", None)


def _drain_seconds(settings: Any) -> float:
    """The longest shutdown grace or drain the service's settings hold."""
    found = [
        float(getattr(settings, field.name))
        for field in dataclasses.fields(settings)
        if field.name.endswith("_seconds") and ("grace" in field.name or "drain" in field.name)
    ]
    assert found, f"no shutdown grace in {type(settings).__qualname__}"
    return max(found)


def _healthcheck_test(service: dict[str, Any]) -> list[str]:
    test = service.get("healthcheck", {}).get("test")
    assert isinstance(test, list) and test, f"no healthcheck test in {service!r}"
    return [str(part) for part in test]


def test_compose_file_is_valid() -> None:
    result = _docker_compose("config", "-q")
    assert result.returncode == 0, result.stderr


def test_compose_runs_real_commands_of_our_image(compose: dict[str, Any]) -> None:
    ours = {name: s for name, s in _services(compose).items() if _our_image(s)}
    assert {"im", "im-migrate", "im-keygen"} <= set(ours)
    for service in ours.values():
        _assert_command_accepted(service.get("command"))
        test = _healthcheck_test(service) if "healthcheck" in service else None
        if test is not None and test[0] == "CMD":
            _assert_command_accepted(test[1:])
    assert _services(compose)["im"]["command"][2:] == ["services.im", "serve"]
    assert _services(compose)["im-migrate"]["command"][2:] == ["services.im", "migrate"]
    assert _services(compose)["im-keygen"]["command"][2:] == ["services.im", "keygen", "--if-missing"]
    assert _services(compose)["gateway"]["command"][2:] == ["gateway", "serve"]
    assert _services(compose)["memory"]["command"][2:] == ["services.memory", "serve"]
    assert _services(compose)["memory-migrate"]["command"][2:] == ["services.memory", "migrate"]


CERTS_MOUNT = "/certs/"
SECRETS_MOUNT = "/var/lib/agentim/secrets/"


def _load_settings(compose: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Each service's settings (of those whose module has any) as it loads
    them in its container, from the files the one-shot services write to
    the volumes it mounts."""
    # The files the `certs` service writes to its volume, as it writes them.
    certs = tmp_path / "certs"
    command = _services(compose)["certs"]["command"]
    module, arguments = _python_module_command(command)
    assert module == "services.common.tls" and arguments[:2] == ["make-dev-certs", CERTS_MOUNT.rstrip("/")]
    make_dev_certs(certs, [name for name in arguments[2:] if not name.startswith("--")])
    # The files the `service-credentials` service writes to its volume.
    assert _services(compose)["service-credentials"]["command"][2:] == ["services.im", "credentials"]
    secrets = tmp_path / "secrets"
    ensure_embedded_credentials(secrets / "service-credentials")
    loaded = {}
    for name, service in _services(compose).items():
        if not _our_image(service):
            continue
        module, _ = _python_module_command(service.get("command"))
        settings_class = _settings_class(module)
        if settings_class is None:
            continue
        environment = service.get("environment", {})
        assert isinstance(environment, dict), f"{name}: use the mapping form of environment"
        mounted = {
            k: str(v).replace(CERTS_MOUNT, f"{certs}/").replace(SECRETS_MOUNT, f"{secrets}/")
            for k, v in environment.items()
        }
        if any(SECRETS_MOUNT in str(v) for v in environment.values()):
            volumes = [str(v).split(":")[:2] for v in service.get("volumes", [])]
            assert ["service-secrets", SECRETS_MOUNT.rstrip("/")] in volumes, (
                f"{name} reads {SECRETS_MOUNT} but does not mount the service-secrets volume"
            )
        if any(CERTS_MOUNT in str(v) for v in environment.values()):
            volumes = [str(v).split(":")[:2] for v in service.get("volumes", [])]
            assert ["certs", "/certs"] in volumes, f"{name} reads /certs but does not mount the certs volume"
        try:
            loaded[name] = settings_class.from_env(mounted)
        except ConfigError as error:
            pytest.fail(f"{name}: {error}")
    return loaded


def test_compose_environments_load_as_settings(compose: dict[str, Any], tmp_path: Path) -> None:
    checked = _load_settings(compose, tmp_path)
    assert {"im", "im-migrate", "runtime", "gateway", "memory", "memory-migrate"} <= set(checked)


def test_compose_im_listens_where_it_is_published_and_probed(compose: dict[str, Any]) -> None:
    im = _services(compose)["im"]
    port = im["environment"]["IM_GRPC_ADDRESS"].rpartition(":")[2]
    assert im["environment"]["IM_GRPC_ADDRESS"].startswith("0.0.0.0:"), "a container must listen on all"
    targets = [str(p).split("/")[0].rpartition(":")[2] for p in im.get("ports", [])]
    assert port in targets, f"port {port} is not published: {im.get('ports')}"
    assert _healthcheck_test(im)[-1] == f"127.0.0.1:{port}"


def test_compose_memory_listens_where_it_is_published_probed_and_migrated(compose: dict[str, Any]) -> None:
    services = _services(compose)
    memory = services["memory"]
    environment = memory["environment"]
    port = environment["MEMORY_GRPC_ADDRESS"].rpartition(":")[2]
    assert environment["MEMORY_GRPC_ADDRESS"].startswith("0.0.0.0:"), "a container must listen on all"
    assert [str(p).split("/")[0].rpartition(":")[2] for p in memory.get("ports", [])] == [port]
    assert _healthcheck_test(memory)[-1] == f"127.0.0.1:{port}"
    assert memory["depends_on"]["memory-migrate"]["condition"] == "service_completed_successfully"
    assert services["memory-migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    # It asks the IM who callers are.
    assert memory["depends_on"]["im"]["condition"] == "service_healthy"
    im_port = services["im"]["environment"]["IM_GRPC_ADDRESS"].rpartition(":")[2]
    assert environment["IM_ADDRESS"] == f"im:{im_port}"
    assert services["runtime"]["environment"]["MEMORY_ADDRESS"] == f"memory:{port}"


def test_compose_postgres_has_pgvector_for_the_memory(compose: dict[str, Any]) -> None:
    services = _services(compose)
    # The pgvector project's image of PostgreSQL 15: the major version the
    # postgres-data volume was made with, and the extension the memory uses.
    assert services["postgres"]["image"] == "pgvector/pgvector:pg15"
    for name in ("memory", "memory-migrate"):
        assert services[name]["environment"]["MEMORY_PGVECTOR"] == "on", name


def test_compose_dependencies_exist_and_wait_for_health(compose: dict[str, Any]) -> None:
    services = _services(compose)
    for name, service in services.items():
        depends_on = service.get("depends_on", {})
        targets = depends_on if isinstance(depends_on, dict) else {key: {} for key in depends_on}
        for target, rule in targets.items():
            assert target in services, f"{name} depends on missing service {target}"
            if (rule or {}).get("condition") == "service_healthy":
                assert "healthcheck" in services[target], (
                    f"{name} waits for {target}, which has no healthcheck"
                )
    for name in ("postgres", "redis", "im"):
        assert _healthcheck_test(services[name])[0] in {"CMD", "CMD-SHELL"}, name
    assert services["im"]["depends_on"]["im-migrate"]["condition"] == "service_completed_successfully"
    assert services["im-migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["im"]["depends_on"]["redis"]["condition"] == "service_healthy"


def test_compose_im_signs_with_a_key_from_its_volume(compose: dict[str, Any]) -> None:
    services = _services(compose)
    im, keygen = services["im"], services["im-keygen"]
    # On PostgreSQL the IM refuses to start without a key: the one-shot makes it first.
    assert im["depends_on"]["im-keygen"]["condition"] == "service_completed_successfully"
    keys = im["environment"]["AUTH_SIGNING_KEYS_DIR"]
    assert keygen["environment"]["AUTH_SIGNING_KEYS_DIR"] == keys

    def mounted(service: dict[str, Any]) -> set[str]:
        found = set()
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                found.add(f"{volume.get('source')}:{volume.get('target')}")
            else:
                found.add(":".join(str(volume).split(":")[:2]))
        return found

    assert f"im-keys:{keys}" in mounted(im) and f"im-keys:{keys}" in mounted(keygen)
    assert "im-keys" in compose.get("volumes", {})


def test_compose_gateway_is_published_probed_untrusted_and_waits_for_its_upstreams(
    compose: dict[str, Any],
) -> None:
    services = _services(compose)
    gateway = services["gateway"]
    environment = gateway["environment"]
    port = environment["GATEWAY_HTTP_ADDRESS"].rpartition(":")[2]
    assert environment["GATEWAY_HTTP_ADDRESS"].startswith("0.0.0.0:")
    assert [str(p).split("/")[0].rpartition(":")[2] for p in gateway.get("ports", [])] == [port]
    assert _healthcheck_test(gateway) == ["CMD", "python", "-m", "gateway.healthcheck", f"127.0.0.1:{port}"]
    # The gateway is no principal: it holds no service credential of its own.
    assert not {key for key in environment if "SERVICE_SECRET" in key or "SERVICE_TOKEN" in key}
    for upstream, variable in (
        ("im", "IM_ADDRESS"),
        ("runtime", "RUNTIME_ADDRESS"),
        ("memory", "MEMORY_ADDRESS"),
    ):
        assert gateway["depends_on"][upstream]["condition"] == "service_healthy"
        listen = services[upstream]["environment"][f"{upstream.upper()}_GRPC_ADDRESS"].rpartition(":")[2]
        assert environment[variable] == f"{upstream}:{listen}"


# Docker's default wait between SIGTERM and SIGKILL.
DEFAULT_STOP_GRACE_SECONDS = 10.0
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)")
_DURATION_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def _duration_seconds(duration: str) -> float:
    """A compose duration (`30s`, `1m30s`, `500ms`) in seconds."""
    parts = _DURATION_PART.findall(duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a duration: {duration!r}"
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def test_compose_runs_the_im_and_the_runtime_as_replicas(compose: dict[str, Any], tmp_path: Path) -> None:
    services = _services(compose)
    for name in ("im", "runtime"):
        service = services[name]
        assert service.get("deploy", {}).get("replicas", 1) == 2, f"{name}: two replicas"
        # Several containers of one service: no fixed name, no fixed host port.
        assert "container_name" not in service and "hostname" not in service, name
        for port in service.get("ports", []):
            host = str(port).split("/")[0].split(":")[:-1]
            assert host in ([], ["127.0.0.1", ""]), f"{name} publishes a fixed host port: {port}"
    # Replicas of the runtime meet through the Redis the IM replicas use, and wait for it.
    runtime = services["runtime"]
    assert runtime["environment"].get("REDIS_URL") == services["im"]["environment"]["REDIS_URL"], (
        "the runtime's replicas need the IM's Redis (REDIS_URL)"
    )
    assert runtime["depends_on"]["redis"]["condition"] == "service_healthy"
    # Loaded as each container loads it: a replica among others, with a name
    # of its own (two containers of one environment never share one).
    loaded = _load_settings(compose, tmp_path)
    first = loaded["runtime"]
    second = _load_settings(compose, tmp_path / "second")["runtime"]
    assert first.leases is not None, "the runtime would run every agent itself: no leases"
    assert second.leases is not None
    assert first.leases.replica != second.leases.replica, "two runtime containers share one replica id"
    assert loaded["im"].redis_url


def test_compose_stop_grace_outlasts_each_services_drain(compose: dict[str, Any], tmp_path: Path) -> None:
    loaded = _load_settings(compose, tmp_path)
    checked = []
    for name, service in _services(compose).items():
        if name not in loaded or _python_module_command(service["command"])[1][:1] != ["serve"]:
            continue
        grace = _duration_seconds(str(service.get("stop_grace_period", f"{DEFAULT_STOP_GRACE_SECONDS}s")))
        drain = _drain_seconds(loaded[name])
        # SIGKILL must not cut the drain short, nor what follows it (the
        # runtime releases its leases after the drain).
        assert grace > drain, f"{name}: stop_grace_period {grace} s, drain {drain} s"
        checked.append(name)
    assert {"im", "runtime", "memory", "gateway"} <= set(checked)
    assert _drain_seconds(loaded["runtime"]) > 5.0, "the runtime's steps in flight get more than the default"


# -- the health probe: python -m services.common.healthcheck ----------------


def _healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_module("services.common.healthcheck", *args),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


@pytest.fixture(scope="module")
def im_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[IMProcess]:
    data_dir = tmp_path_factory.mktemp("im-health")
    env = im_environment(data_dir)
    migrate_im(env)
    with running_im(env, data_dir / "im.log") as im:
        yield im
        im.terminate()


def test_healthcheck_exits_0_on_a_serving_server(im_server: IMProcess) -> None:
    for args in ([], ["--service", IM_SERVICE], ["--timeout", "2"]):
        result = _healthcheck(im_server.address, *args)
        assert result.returncode == 0, result.stderr
        assert "SERVING" in result.stdout


def test_healthcheck_exits_1_for_an_unknown_service(im_server: IMProcess) -> None:
    result = _healthcheck(im_server.address, "--service", "no.such.Service")
    assert result.returncode == 1
    assert "NOT_FOUND" in result.stderr


def test_healthcheck_exits_1_when_nothing_listens() -> None:
    # A port that was just free: bind, read it back, close.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    result = _healthcheck(f"127.0.0.1:{port}", "--timeout", "2")
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr


def test_healthcheck_exits_1_when_the_database_is_down(tmp_path: Path) -> None:
    # Nothing listens on port 1: the readiness probe fails, the server says NOT_SERVING.
    env = im_environment(tmp_path, DATABASE_URL="postgresql://nobody@127.0.0.1:1/none")
    # On PostgreSQL the IM makes no signing key of its own: an operator's step.
    keygen = subprocess.run(
        python_module("services.im", "keygen"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert keygen.returncode == 0, keygen.stderr
    with running_im(env, tmp_path / "im.log") as im:
        result = _healthcheck(im.address, "--timeout", "5")
        assert result.returncode == 1, result.stdout + result.stderr
        assert "NOT_SERVING" in result.stdout
        assert im.terminate() == 0


@pytest.mark.parametrize(
    "args",
    [
        pytest.param([], id="no-address"),
        pytest.param(["localhost"], id="no-port"),
        pytest.param(["127.0.0.1:50051", "--timeout", "0"], id="zero-timeout"),
    ],
)
def test_healthcheck_exits_2_on_bad_arguments(args: list[str]) -> None:
    assert _healthcheck(*args).returncode == 2


def test_compose_postgres_has_room_for_every_replicas_pool_at_its_peak(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    """Each process keeps up to its pool open and as many more at a peak; with
    three runtime replicas (`--scale runtime=3`) PostgreSQL still accepts them all."""
    services = _services(compose)
    command = services["postgres"].get("command", [])
    limits = [part.split("=", 1)[1] for part in command if str(part).startswith("max_connections=")]
    max_connections = int(limits[0]) if limits else 100  # PostgreSQL's default
    loaded = _load_settings(compose, tmp_path)
    peak = {
        "im": 2 * loaded["im"].db_pool_size * services["im"]["deploy"]["replicas"],
        "runtime": 2 * (loaded["runtime"].db_pool_size + LEASE_CONNECTIONS) * 3,
        "memory": 2 * 16,
    }
    # Migrations, health probes and an operator's psql.
    assert sum(peak.values()) + 10 <= max_connections, f"{peak} against max_connections={max_connections}"
