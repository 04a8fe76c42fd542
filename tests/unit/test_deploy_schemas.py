"""deploy/*.yaml against Kubernetes' own OpenAPI schemas (kubernetes-validate, offline, strict: an unknown
field is an error), for the oldest Kubernetes the manifests claim (the pod-index label, `spec.ordinals`:
1.28) and a recent pinned one. No cluster and no kubectl needed.

Custom resources (KubeRay's RayCluster) have no schema in that package, and none is invented here: such
a document is reported as skipped, with the reason, and must be listed in `no_schema_skips`; the pod templates
inside it are core/v1 `PodTemplateSpec`s and are validated as such. A built-in kind (StatefulSet,
Service, ...) whose schema is missing (a wrong apiVersion) or that fails validation fails the test."""

from __future__ import annotations

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
# deploy/README.md: Kubernetes >= 1.28; 1.37: the newest the pinned kubernetes-validate==1.37.0 bundles
KUBERNETES_VERSIONS = ("1.28.0", "1.37.0")
NOT_KUBERNETES = {"ray-cluster.yaml"}  # Ray's cluster-launcher config (`ray up`): no apiVersion / kind


def no_schema_skips(version: str) -> dict[str, str]:
    """The documents the test skips for want of a schema, and why: custom resources (see above)."""
    reason = (
        "custom resource (ray.io/v1): no schema for Kubernetes {}; only its 2 pod template(s) were validated"
    )
    return {"kuberay-raycluster.yaml#0 RayCluster/speedpipe": reason.format(version)}


def _is_custom(api_version: str) -> bool:
    """A custom resource's API group has a dot and is not one of Kubernetes' own (`*.k8s.io`)."""
    group = api_version.rpartition("/")[0]
    return "." in group and not group.endswith(".k8s.io")


def _pod_templates(obj) -> list[dict]:
    """Every pod template (a `template` holding `spec.containers`) inside a parsed document."""
    found = []
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key == "template" and isinstance(value, dict) and "containers" in value.get("spec", {}):
                found.append(value)
            else:
                found += _pod_templates(value)
    elif isinstance(obj, list):
        for value in obj:
            found += _pod_templates(value)
    return found


def _error(doc: dict, version: str) -> str | None:
    """Why `doc` fails strict validation for Kubernetes `version` (None: it passes); a missing schema
    raises kubernetes_validate.SchemaNotFoundError."""
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        return f"{'.'.join(map(str, exc.absolute_path)) or '(top)'}: {exc.message}"
    return None


def validate_folder(folder: Path, version: str) -> tuple[list[str], dict[str, str], set[str]]:
    """Validate every document of every `*.yaml` in `folder`. Returns (errors, skipped documents ->
    why, files that hold no Kubernetes document); a document is named `file#index Kind/name`."""
    errors, skipped, not_kubernetes = [], {}, set()
    for path in sorted(folder.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        if not any(isinstance(d, dict) and "apiVersion" in d and "kind" in d for d in docs):
            not_kubernetes.add(path.name)
            continue
        for index, doc in enumerate(docs):
            name = f"{path.name}#{index} {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            try:
                if (error := _error(doc, version)) is not None:
                    errors.append(f"{name}: {error}")
            except kubernetes_validate.SchemaNotFoundError:
                if not _is_custom(doc["apiVersion"]):
                    errors.append(f"{name}: Kubernetes {version} has no {doc['kind']} in {doc['apiVersion']}")
                    continue
                skipped[name] = (
                    f"custom resource ({doc['apiVersion']}): no schema for Kubernetes {version}; "
                    f"only its {len(_pod_templates(doc))} pod template(s) were validated"
                )
                for template in _pod_templates(doc):
                    pod = {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": "t"},
                        "template": template,
                    }
                    if (error := _error(pod, version)) is not None:
                        errors.append(f"{name}: pod template: {error.removeprefix('template.')}")
    return errors, skipped, not_kubernetes


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_kubernetes_manifest_passes_strict_schema_validation(version):
    errors, skipped, not_kubernetes = validate_folder(DEPLOY, version)
    assert not errors, "\n".join(errors)
    assert not_kubernetes == NOT_KUBERNETES
    assert skipped == no_schema_skips(version), f"skipped without a schema: {skipped}"


BROKEN = """\
apiVersion: v1
kind: Service
metadata: {name: fine}
spec:
  ports: [{name: http, port: 8000}]
---
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: broken}
spec:
  serviceNmae: nodes
  selector: {matchLabels: {app: x}}
  template:
    metadata: {labels: {app: x}}
    spec:
      containers: [{name: c, image: i}]
---
apiVersion: apps/v1beta1
kind: Deployment
metadata: {name: gone-api}
spec: {}
---
apiVersion: ray.io/v1
kind: RayCluster
metadata: {name: custom}
spec:
  headGroupSpec:
    template:
      spec:
        containers: [{name: head, image: i, ports: [{containerPort: "6379"}]}]
"""


def test_a_misspelled_field_a_wrong_type_and_an_unknown_built_in_api_fail(tmp_path):
    (tmp_path / "broken.yaml").write_text(BROKEN)
    errors, skipped, _ = validate_folder(tmp_path, KUBERNETES_VERSIONS[-1])
    assert len(errors) == 3, errors
    assert (
        errors[0].startswith("broken.yaml#1 StatefulSet/broken: spec: ")
        and "'serviceNmae' was unexpected" in errors[0]
    )
    assert (
        errors[1] == "broken.yaml#2 Deployment/gone-api: Kubernetes 1.37.0 has no Deployment in apps/v1beta1"
    )
    assert errors[2].startswith(
        "broken.yaml#3 RayCluster/custom: pod template: spec.containers.0.ports.0.containerPort"
    )
    assert list(skipped) == ["broken.yaml#3 RayCluster/custom"]
    assert "custom resource (ray.io/v1)" in skipped["broken.yaml#3 RayCluster/custom"]
