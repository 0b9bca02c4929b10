"""The Kubernetes manifests (deploy/kubernetes/) checked offline.

No cluster runs here. Each kustomization is rendered with `kubectl kustomize`
and every object it makes is validated against the Kubernetes API schemas
(kubernetes-validate, strict: an unknown field is an error) of the oldest
and the newest release the manifests are for. The workloads are then checked
against the code, as tests/e2e/test_compose.py checks the compose file: each
command is accepted by the module it names, each environment loads as that
service's settings and sets nothing the service does not read, secrets come
only from Secrets, and the probes and shutdown timing fit the service.

The example overlay renders with secrets made the way its comments tell a
user to make them, so that its documented steps are checked too.
"""

from __future__ import annotations

import base64
import importlib
import re
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.sessions import new_session_key
from services.common.settings import ConfigError
from services.common.tls import make_dev_certs
from services.common.tokens import KeyRing
from services.im.adapters.service_credentials import ensure_embedded_credentials
from services.im.bootstrap import prepare_identity
from services.im.config import Settings as IMSettings

from . import ROOT, in_ci
from .test_compose import _drain_seconds, _python_module_command, _settings_class

KUBERNETES = ROOT / "deploy" / "kubernetes"
# An older release with every field used (gRPC probes are GA since 1.27)
# and the newest kubernetes-validate bundles.
SCHEMA_VERSIONS = ("1.29.0", "1.37.0")
AUTOSCALING = "queue-depth-autoscaling"
MUTUAL_TLS = "mutual-tls"
COMPONENTS = (AUTOSCALING, MUTUAL_TLS)
# The example overlay alone and with each component, as their comments say to include them.
OVERLAYS = ("overlays/example", *(f"overlays/example+{component}" for component in COMPONENTS))
RENDERS = ("base", *OVERLAYS)
SERVICES = ("im", "runtime", "memory", "gateway")
EXAMPLE_IMAGE = "registry.example.com/agentim:0.1.0"
EXAMPLE_NAMESPACE = "agentim"
# Secrets made outside the kustomization, from these directories of the
# example overlay's secrets/: the signing keys (the overlay's step 2: their
# files are named by their key ids, which a rotation changes) and the
# certificates of the mutual-tls component.
OUT_OF_BAND_SECRETS = {"agentim-im-signing-keys": "keys", "agentim-tls": "tls"}
# Variables naming a file or directory of secrets: only ever in a Secret volume.
SECRET_PATH = re.compile(r"((SECRET|KEYS|CREDENTIALS)_(FILE|DIR)|^GRPC_TLS_KEY)$")
# Variables holding a secret itself: only ever from a secretKeyRef.
SECRET_VALUE = re.compile(r"(SECRET|PASSWORD|TOKEN|_KEY|DATABASE_URL|REDIS_URL)$")
CREDENTIALS_IN_URL = re.compile(r"://[^/@\s]+:[^/@\s]*@")
# The pod's fields a container may read (the Downward API): only its name.
POD_FIELDS = {"metadata.name"}

Manifest = dict[str, Any]


# -- rendering ------------------------------------------------------------------


def _kubectl() -> str:
    command = shutil.which("kubectl")
    if command is None:
        reason = "kubectl is missing: install kubectl 1.27 or later (`kubectl kustomize` renders offline)"
        if in_ci():
            pytest.fail(reason)
        pytest.skip(reason)
    return command


def _render(directory: Path) -> list[Manifest]:
    result = subprocess.run(
        [_kubectl(), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"kubectl kustomize {directory}:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/kubernetes whose example overlay has its secrets, made
    by the project's own code as the overlay's step 1 makes them."""
    copy = tmp_path_factory.mktemp("kubernetes") / "kubernetes"
    shutil.copytree(KUBERNETES, copy)
    secrets = copy / "overlays" / "example" / "secrets"
    shutil.rmtree(secrets)
    # python -m services.im credentials / keygen, python -m gateway keygen
    ensure_embedded_credentials(secrets / "service-credentials")
    KeyRing.generate(secrets / "keys")
    (secrets / "gateway-session-key").write_text(new_session_key() + "\n")
    (secrets / "database-url").write_text("postgresql://agentim:not-a-password@postgres.example:5432/agentim")
    (secrets / "redis-url").write_text("redis://redis.example:6379/0")
    # The mutual-tls component's certificates, as its comment makes them.
    make_dev_certs(secrets / "tls", SERVICES)
    for component in COMPONENTS:
        overlay = copy / "overlays" / f"example+{component}"
        shutil.copytree(copy / "overlays" / "example", overlay)
        with (overlay / "kustomization.yaml").open("a") as kustomization:
            kustomization.write(f"\ncomponents:\n  - ../../components/{component}\n")
    return copy


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Manifest]]:
    return {name: _render(tree / name) for name in RENDERS}


@pytest.fixture(scope="module")
def base(rendered: dict[str, list[Manifest]]) -> list[Manifest]:
    return rendered["base"]


@pytest.fixture(scope="module")
def example(rendered: dict[str, list[Manifest]]) -> list[Manifest]:
    return rendered["overlays/example"]


# -- reading manifests ----------------------------------------------------------


def _name(manifest: Manifest) -> str:
    return f"{manifest['kind']}/{manifest['metadata']['name']}"


def _of_kind(manifests: list[Manifest], kind: str) -> dict[str, Manifest]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def _workloads(manifests: list[Manifest]) -> dict[str, Manifest]:
    """Deployments and Jobs by kind/name."""
    return {_name(m): m for m in manifests if m["kind"] in {"Deployment", "Job"}}


def _pod(workload: Manifest) -> Manifest:
    pod: Manifest = workload["spec"]["template"]["spec"]
    return pod


def _container(workload: Manifest) -> Manifest:
    containers = _pod(workload)["containers"]
    assert len(containers) == 1, f"{_name(workload)}: one container expected"
    container: Manifest = containers[0]
    return container


def _env(container: Manifest) -> dict[str, Manifest]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def _selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# -- environments as the services see them --------------------------------------


class _ReadRecorder(Mapping[str, str]):
    """An environment that remembers which variables were looked up."""

    def __init__(self, values: Mapping[str, str]) -> None:
        self._values = dict(values)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)


def _secret_data(manifests: list[Manifest], name: str) -> dict[str, bytes] | None:
    secret = _of_kind(manifests, "Secret").get(name)
    if secret is None:
        return None
    data = {key: base64.b64decode(value) for key, value in secret.get("data", {}).items()}
    data.update({key: value.encode() for key, value in secret.get("stringData", {}).items()})
    return data


def _out_of_band_secret(tree: Path, name: str) -> dict[str, bytes]:
    """A Secret made with `kubectl create secret generic NAME --from-file=DIRECTORY/`."""
    directory = tree / "overlays" / "example" / "secrets" / OUT_OF_BAND_SECRETS[name]
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def _pod_name(workload: Manifest, suffix: str = "5d8f7c6b9-x7k2p") -> str:
    """A name the ReplicaSet of a Deployment could give one of its pods."""
    return f"{workload['metadata']['name']}-{suffix}"


def _materialize(
    workload: Manifest, manifests: list[Manifest], tree: Path, scratch: Path, *, pod_name: str | None = None
) -> dict[str, str]:
    """The container's environment as the kubelet would give it in the pod
    named `pod_name`, with each Secret volume written to a directory of
    `scratch` and paths into the volumes pointing there."""
    pod, container = _pod(workload), _container(workload)
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    mounts: dict[str, Path] = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        assert secret is not None, f"{_name(workload)}: volume {mount['name']} is not a Secret"
        name = secret["secretName"]
        data = _secret_data(manifests, name)
        if data is None:
            assert name in OUT_OF_BAND_SECRETS, f"{_name(workload)}: Secret {name} is made by no one"
            data = _out_of_band_secret(tree, name)
        items = secret.get("items") or [{"key": key, "path": key} for key in data]
        directory = scratch / _name(workload).replace("/", "-") / mount["name"]
        directory.mkdir(parents=True)
        for item in items:
            assert item["key"] in data, f"{_name(workload)}: Secret {name} has no key {item['key']}"
            target = directory / item["path"]
            target.write_bytes(data[item["key"]])
            target.chmod(0o600)
        mounts[mount["mountPath"].rstrip("/")] = directory
    environment = {}
    for variable, entry in _env(container).items():
        if "value" in entry or "valueFrom" not in entry:
            value = str(entry.get("value", ""))
            for path, directory in mounts.items():
                if value == path or value.startswith(f"{path}/"):
                    value = str(directory) + value[len(path) :]
            environment[variable] = value
            continue
        if "fieldRef" in entry["valueFrom"]:
            field_path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert field_path in POD_FIELDS, f"{_name(workload)}: {variable} from {field_path}"
            environment[variable] = pod_name or _pod_name(workload)
            continue
        reference = entry["valueFrom"]["secretKeyRef"]
        data = _secret_data(manifests, reference["name"])
        if data is None or reference["key"] not in data:
            assert reference.get("optional"), (
                f"{_name(workload)}: {variable} needs Secret {reference['name']}, which the overlay lacks"
            )
            continue
        environment[variable] = data[reference["key"]].decode()
    return environment


def _module(workload: Manifest) -> str:
    module, _ = _python_module_command(_container(workload)["command"])
    return module


def _assert_command_accepted(command: Any) -> None:
    """As `python -m MODULE ARGS... --help` would (argparse checks the
    subcommand before it acts on --help), in this process: seven
    interpreters importing the services cost seconds of CPU."""
    module, arguments = _python_module_command(command)
    imported = importlib.import_module(module)
    # `python -m` runs a package's __main__, or the module itself.
    main = (
        importlib.import_module(f"{module}.__main__").main if hasattr(imported, "__path__") else imported.main
    )
    with pytest.raises(SystemExit) as exited:
        main([*arguments, "--help"])
    assert exited.value.code in (0, None), f"{command!r} is refused by {module}"


def _pre_stop_seconds(container: Manifest) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    assert pre_stop is not None, f"{container['name']}: no preStop"
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"{container['name']}: preStop is not a delay"
    return float(command[1])


# -- the tests ----------------------------------------------------------------------


def test_every_kustomization_is_rendered_by_this_test() -> None:
    found = {str(path.parent.relative_to(KUBERNETES)) for path in KUBERNETES.rglob("kustomization.yaml")}
    checked = {name for name in RENDERS if "+" not in name} | {f"components/{c}" for c in COMPONENTS}
    assert found == checked, "a kustomization this test does not render (add it to RENDERS)"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("render", RENDERS)
def test_every_rendered_object_is_valid(
    rendered: dict[str, list[Manifest]], render: str, version: str
) -> None:
    problems = []
    for manifest in rendered[render]:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            where = "/".join(str(part) for part in error.path)
            problems.append(f"{_name(manifest)} at {where}: {error.message}")
    assert not problems, f"{render} against Kubernetes {version}:\n" + "\n".join(problems)


def test_the_base_runs_each_service_with_its_promised_replicas(base: list[Manifest]) -> None:
    deployments = _of_kind(base, "Deployment")
    assert set(deployments) == {"im", "runtime", "memory", "gateway"}
    assert {name: _module(d) for name, d in deployments.items()} == {
        "im": "services.im",
        "runtime": "services.runtime",
        "memory": "services.memory",
        "gateway": "gateway",
    }
    # Every service runs as replicas (the runtime's own agents by shard
    # leases), and a rollout starts a new pod before an old one stops.
    for name, deployment in deployments.items():
        assert deployment["spec"]["replicas"] >= 2, name
        assert deployment["spec"]["strategy"] == {
            "type": "RollingUpdate",
            "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
        }, name
    assert not _of_kind(base, "HorizontalPodAutoscaler")
    assert not _of_kind(base, "Secret"), "the base holds no secret: an overlay makes them"


@pytest.mark.parametrize("render", OVERLAYS)
def test_runtime_pods_are_replicas_each_named_by_its_pod(
    rendered: dict[str, list[Manifest]], render: str, tree: Path, tmp_path: Path
) -> None:
    manifests = rendered[render]
    runtime, im = _of_kind(manifests, "Deployment")["runtime"], _of_kind(manifests, "Deployment")["im"]
    # The Redis the IM replicas meet through, from the same Secret.
    redis = _env(_container(runtime)).get("REDIS_URL", {}).get("valueFrom")
    assert redis == _env(_container(im))["REDIS_URL"]["valueFrom"], "the runtime needs the IM's REDIS_URL"
    replicas = set()
    for suffix in ("5d8f7c6b9-x7k2p", "5d8f7c6b9-q4m9z"):
        pod = _pod_name(runtime, suffix)
        environment = _materialize(runtime, manifests, tree, tmp_path / suffix, pod_name=pod)
        leases = _settings_class(_module(runtime)).from_env(environment).leases
        assert leases is not None, "the runtime pods would each run every agent: no leases"
        assert leases.replica == pod
        replicas.add(leases.replica)
    assert len(replicas) == 2
    # At most one pod away at a time, for voluntary disruptions.
    assert _of_kind(manifests, "PodDisruptionBudget")["runtime"]["spec"] == {
        "maxUnavailable": 1,
        "selector": {"matchLabels": {"app.kubernetes.io/name": "runtime"}},
    }


def test_the_autoscaling_example_scales_the_runtime_on_an_external_queue_metric(
    rendered: dict[str, list[Manifest]],
) -> None:
    manifests = rendered[f"overlays/example+{AUTOSCALING}"]
    (autoscaler,) = _of_kind(manifests, "HorizontalPodAutoscaler").values()
    target = autoscaler["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", "runtime")
    assert [metric["type"] for metric in autoscaler["spec"]["metrics"]] == ["External"]
    runtime = _of_kind(manifests, "Deployment")["runtime"]
    # Else each apply would reset the autoscaler's replica count.
    assert "replicas" not in runtime["spec"]
    assert runtime["spec"]["strategy"]["type"] == "RollingUpdate"
    # Never fewer than two: one pod can stop while the other runs every agent.
    assert 2 <= autoscaler["spec"]["minReplicas"] < autoscaler["spec"]["maxReplicas"]
    assert autoscaler["metadata"]["namespace"] == EXAMPLE_NAMESPACE


def test_the_example_overlay_sets_image_and_namespace_everywhere(example: list[Manifest]) -> None:
    for manifest in example:
        assert manifest["metadata"].get("namespace") == EXAMPLE_NAMESPACE, _name(manifest)
    for name, workload in _workloads(example).items():
        assert _container(workload)["image"] == EXAMPLE_IMAGE, name


def test_every_command_is_accepted_and_every_service_is_migrated(example: list[Manifest]) -> None:
    workloads = _workloads(example)
    for workload in workloads.values():
        _assert_command_accepted(_container(workload)["command"])
    migrations = {_module(job): _container(job)["command"][3:] for job in _of_kind(example, "Job").values()}
    assert migrations == {
        module: ["migrate"] for module in ("services.im", "services.runtime", "services.memory")
    }


@pytest.mark.parametrize("render", OVERLAYS)
def test_every_environment_loads_as_settings_and_sets_only_what_the_service_reads(
    rendered: dict[str, list[Manifest]], render: str, tree: Path, tmp_path: Path
) -> None:
    example = rendered[render]
    for name, workload in _workloads(example).items():
        environment = _ReadRecorder(_materialize(workload, example, tree, tmp_path))
        settings_class = _settings_class(_module(workload))
        try:
            settings = settings_class.from_env(environment)
        except ConfigError as error:
            pytest.fail(f"{name}: {error}")
        unread = set(environment) - environment.read
        assert not unread, f"{name} sets variables {_module(workload)} never reads: {sorted(unread)}"
        if isinstance(settings, IMSettings) and _container(workload)["command"][3:] == ["serve"]:
            # The signing keys and the services' hashes, as mounted, load.
            try:
                identity = prepare_identity(settings)
            except ConfigError as error:
                pytest.fail(f"{name}: {error}")
            assert set(identity.services) == {"runtime", "memory"}


@pytest.mark.parametrize("render", RENDERS)
def test_secrets_come_only_from_secrets(rendered: dict[str, list[Manifest]], render: str) -> None:
    for name, workload in _workloads(rendered[render]).items():
        pod, container = _pod(workload), _container(workload)
        secret_volumes = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
        secret_mounts = [
            m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in secret_volumes
        ]
        for variable, entry in _env(container).items():
            value = entry.get("value")
            if value is not None:
                assert not CREDENTIALS_IN_URL.search(value), f"{name}: {variable} holds a password"
            if "valueFrom" in entry:
                assert set(entry["valueFrom"]) in ({"secretKeyRef"}, {"fieldRef"}), f"{name}: {variable}"
            if SECRET_VALUE.search(variable) and not SECRET_PATH.search(variable):
                assert "secretKeyRef" in entry.get("valueFrom", {}), (
                    f"{name}: {variable} is a secret: set it with a secretKeyRef"
                )
            if SECRET_PATH.search(variable):
                assert value is not None and any(
                    value == mount or value.startswith(f"{mount}/") for mount in secret_mounts
                ), f"{name}: {variable} names a file outside the Secret volumes"


@pytest.mark.parametrize("render", OVERLAYS)
def test_deployments_probe_drain_and_request_resources(
    rendered: dict[str, list[Manifest]], render: str, tree: Path, tmp_path: Path
) -> None:
    example = rendered[render]
    for name, deployment in _of_kind(example, "Deployment").items():
        pod, container = _pod(deployment), _container(deployment)
        environment = _materialize(deployment, example, tree, tmp_path)
        settings = _settings_class(_module(deployment)).from_env(environment)
        ports = {port["name"]: port["containerPort"] for port in container["ports"]}
        readiness, liveness = container.get("readinessProbe"), container.get("livenessProbe")
        assert readiness and liveness, f"{name}: readiness and liveness probes are required"
        if name == "gateway":
            listen = _port(environment["GATEWAY_HTTP_ADDRESS"])
            assert ports == {"http": listen}
            assert readiness["httpGet"] == {"path": "/healthz", "port": "http"}
            # Not /healthz: an upstream's outage must not restart the gateways.
            assert liveness["httpGet"]["path"] != "/healthz"
        else:
            listen = _port(settings.grpc_address)
            assert ports == {"grpc": listen}, name
            # grpc.health.v1 on the port the service listens on, for the server as a whole.
            for probe in (readiness, liveness, container.get("startupProbe")):
                assert probe is not None, name
                if "grpc" in probe:
                    assert probe["grpc"] == {"port": listen}, name
                    assert settings.tls.server is None, f"{name}: the kubelet's gRPC probe speaks no TLS"
                else:
                    # Over TLS, checking the certificate for the name clients call it by.
                    command = probe["exec"]["command"]
                    assert command[:2] == ["env", f"GRPC_TLS_SERVER_NAME={name}"], name
                    assert command[2:] == [
                        "python",
                        "-m",
                        "services.common.healthcheck",
                        f"127.0.0.1:{listen}",
                    ]
                    assert settings.tls.server is not None and settings.tls.client is not None, name
                    _assert_command_accepted(command[2:])
        # The probe that restarts gives up later than the one that only takes the pod out.
        assert (
            liveness["periodSeconds"] * liveness["failureThreshold"]
            > readiness["periodSeconds"] * readiness["failureThreshold"]
        ), name
        drain, delay = _drain_seconds(settings), _pre_stop_seconds(container)
        assert delay > 0, name
        assert pod["terminationGracePeriodSeconds"] > delay + drain, (
            f"{name}: the grace period must outlast the preStop delay ({delay} s) and the drain ({drain} s)"
        )
        requests = container.get("resources", {}).get("requests", {})
        assert {"cpu", "memory"} <= set(requests), f"{name}: resource requests"
    for name, job in _of_kind(example, "Job").items():
        assert {"cpu", "memory"} <= set(_container(job).get("resources", {}).get("requests", {})), name


def test_services_budgets_and_addresses_reach_the_pods(example: list[Manifest]) -> None:
    deployments = _of_kind(example, "Deployment")
    services = _of_kind(example, "Service")
    budgets = _of_kind(example, "PodDisruptionBudget")
    for name, deployment in deployments.items():
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        container = _container(deployment)
        service = services[name]
        assert _selects(service["spec"]["selector"], labels), f"Service {name} selects no pod of {name}"
        names = {port["name"] for port in container["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in names, f"Service {name} targets no port of the container"
        budget = budgets[name]["spec"]
        assert _selects(budget["selector"]["matchLabels"], labels), f"budget {name} selects no pod"
        # maxUnavailable, never minAvailable equal to the replicas: a drain must be able to proceed.
        assert budget.get("maxUnavailable") == 1 and "minAvailable" not in budget, name
        # No other Deployment's pods are selected by its Service.
        for other, other_deployment in deployments.items():
            if other != name:
                other_labels = other_deployment["spec"]["template"]["metadata"]["labels"]
                assert not _selects(service["spec"]["selector"], other_labels), (name, other)
    # Every address a service calls is a Service's name and port.
    published = {f"{name}:{port['port']}" for name, s in services.items() for port in s["spec"]["ports"]}
    for name, workload in _workloads(example).items():
        for variable, entry in _env(_container(workload)).items():
            if variable.endswith("_ADDRESS") and not variable.endswith(("_GRPC_ADDRESS", "_HTTP_ADDRESS")):
                assert entry["value"] in published, f"{name}: {variable}={entry['value']} is no Service"
