"""infra/k8s validates offline, and says what the code says.

Kubernetes objects are checked against the schemas `kubernetes-validate` ships
(strict: an unknown field is an error, as `kubectl apply` does by default);
KEDA's ScaledObjects against the CRD kept in infra/k8s/crds (unknown fields
refused as with server-side strict field validation). Then the wiring: every
service's command parses with toolgate's own parser, probes hit the port it
serves, every tool has an executor Deployment and a ScaledObject on its
durable, every Secret and ConfigMap referenced exists.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from toolgate.cli.main import build_parser
from toolgate.contracts.registry import BUILTIN_TOOLS_DIR, load_registry
from toolgate.runtime.topology import handlers

K8S = Path(__file__).resolve().parents[2] / "infra" / "k8s"
KUBERNETES_VERSION = "1.37.0"
# What KEDA's nats-jetstream scaler needs in its metadata (keda.sh/docs scalers/nats-jetstream).
NATS_JETSTREAM_REQUIRED = {"natsServerMonitoringEndpoint", "account", "stream", "consumer"}


def _documents() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((path.name, doc))
    return found


DOCS = _documents()


def _of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in DOCS if doc["kind"] == kind]


def _closed(schema: Any) -> Any:
    """An openAPIV3Schema as a JSON Schema refusing fields it does not declare (what a
    structural schema plus strict field validation does), open where it says so."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    return schema


def _scaled_object_schema() -> dict[str, Any]:
    crd = yaml.safe_load((K8S / "crds" / "keda.sh_scaledobjects.yaml").read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")
    return dict(_closed(copy.deepcopy(version["schema"]["openAPIV3Schema"])))


@pytest.mark.parametrize(
    "name, doc",
    [
        (f"{n}:{d['kind']}/{d['metadata']['name']}", d)
        for n, d in DOCS
        if d["kind"] != "ScaledObject"
    ],
)
def test_kubernetes_objects_validate_strictly(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_keda_crd_is_itself_a_valid_crd() -> None:
    crd = yaml.safe_load((K8S / "crds" / "keda.sh_scaledobjects.yaml").read_text())
    kubernetes_validate.validate(crd, KUBERNETES_VERSION, strict=True)


def test_scaled_objects_validate_against_kedas_crd() -> None:
    schema = _scaled_object_schema()
    objects = _of_kind("ScaledObject")
    assert objects
    for doc in objects:
        jsonschema.validate(doc, schema)
        assert doc["apiVersion"] == "keda.sh/v1alpha1"


def test_the_crd_schema_refuses_what_keda_would() -> None:
    schema = _scaled_object_schema()
    good = _of_kind("ScaledObject")[0]
    for broken in (
        {**good, "spec": {k: v for k, v in good["spec"].items() if k != "triggers"}},
        {**good, "spec": {**good["spec"], "maxReplicas": 3}},  # not a field: maxReplicaCount
        {**good, "spec": {**good["spec"], "minReplicaCount": "1"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_every_tool_has_an_executor_deployment_scaled_on_its_durable() -> None:
    tools = load_registry(BUILTIN_TOOLS_DIR).names()
    durables = {h.durable: h for h in handlers(tools) if h.service == "executor"}
    deployments = {d["metadata"]["name"]: d for d in _of_kind("Deployment")}
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in _of_kind("ScaledObject")}
    for tool in tools:
        name = "executor-" + tool.replace("_", "-")
        command = deployments[name]["spec"]["template"]["spec"]["containers"][0]["command"]
        args = build_parser().parse_args(command[1:])
        assert args.name == "executor" and args.tools == tool
        (trigger,) = scaled[name]["spec"]["triggers"]
        assert trigger["type"] == "nats-jetstream"
        assert NATS_JETSTREAM_REQUIRED <= set(trigger["metadata"])
        durable = durables[trigger["metadata"]["consumer"]]
        assert durable.filter_subject.endswith(f".{tool}")
        assert trigger["metadata"]["stream"] == durable.stream


def test_every_service_runs_as_its_own_role_with_probes_on_its_port() -> None:
    parser = build_parser()
    services = set()
    for deployment in _of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = parser.parse_args(container["command"][1:])
        assert args.command == "serve", shlex.join(container["command"])
        services.add(args.name)
        assert args.http_host == "0.0.0.0"
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["http"] == args.http_port
        assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        # Its own creds only: the one key of the creds Secret it mounts is its role's.
        creds = next(v for v in pod["volumes"] if v["name"] == "creds")["secret"]
        assert [item["key"] for item in creds["items"]] == [f"{args.name}.creds"]
        assert str(args.creds) == f"/creds/{args.name}.creds"
    assert services == {h.service for h in handlers(["echo"], with_audit=True)}


def test_everything_referenced_is_declared() -> None:
    secrets = {d["metadata"]["name"]: d for d in _of_kind("Secret")}
    config_maps = {d["metadata"]["name"]: d for d in _of_kind("ConfigMap")}
    for _, doc in DOCS:
        text = yaml.safe_dump(doc)
        for ref in _find(doc, "secretKeyRef") + _find(doc, "configMapKeyRef"):
            pool = secrets if ref in _find(doc, "secretKeyRef") else config_maps
            assert ref["key"] in (pool[ref["name"]].get("stringData") or pool[ref["name"]]["data"])
        for volume in _find(doc, "secret"):
            if isinstance(volume, dict) and "secretName" in volume:
                declared = secrets[volume["secretName"]]["stringData"]
                assert all(item["key"] in declared for item in volume.get("items", []))
        assert "namespace: toolgate" in text or doc["kind"] == "Namespace"


def _find(node: Any, key: str) -> list[Any]:
    found = []
    if isinstance(node, dict):
        for k, v in node.items():
            if k == key:
                found.append(v)
            found += _find(v, key)
    elif isinstance(node, list):
        for item in node:
            found += _find(item, key)
    return found
