"""Kubernetes manifests checked offline: every document against the Kubernetes API's own schemas (the
kubernetes-validate package ships them, strict: an unknown field is an error), and every workload
against Crucible's hardening policy (`k8s_policy`), which is shown to fail on a manifest without it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from k8s_policy import ray_pod_templates, violations

KUBERNETES = "1.33"


def manifests(repo: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
        for path in sorted((repo / "infra" / "k8s").glob("*.yaml"))
    }


RAY_CLUSTER_FIELDS = {
    "spec": {"rayVersion", "headGroupSpec", "workerGroupSpecs"},
    "headGroupSpec": {"rayStartParams", "template", "serviceType"},
    "worker": {"groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams", "template"},
}
"""The RayCluster (ray.io/v1) fields the manifest may use; its pod templates are checked as Kubernetes's
own."""


def _as_kubernetes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The documents the Kubernetes schemas can check: a RayCluster (a KubeRay custom resource, whose
    schema is the operator's) stands for its pod templates, each as a v1 PodTemplate."""
    if doc["kind"] != "RayCluster":
        return [doc]
    return [
        {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": f"{doc['metadata']['name']}-{group}"},
            "template": template,
        }
        for group, template in ray_pod_templates(doc).items()
    ]


def _ray_cluster_errors(doc: dict[str, Any]) -> list[str]:
    spec = doc["spec"]
    errors = [f"spec.{k} is not a RayCluster field" for k in spec.keys() - RAY_CLUSTER_FIELDS["spec"]]
    errors += [
        f"headGroupSpec.{k}" for k in spec["headGroupSpec"].keys() - RAY_CLUSTER_FIELDS["headGroupSpec"]
    ]
    for group in spec["workerGroupSpecs"]:
        errors += [f"{group['groupName']}.{k}" for k in group.keys() - RAY_CLUSTER_FIELDS["worker"]]
        if not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            errors.append(f"{group['groupName']}: replicas outside [minReplicas, maxReplicas]")
        errors += [
            f"{group['groupName']}.rayStartParams.{k}: not a string"
            for k, v in group["rayStartParams"].items()
            if not isinstance(v, str)
        ]
    if doc["apiVersion"] != "ray.io/v1":
        errors.append(f"apiVersion {doc['apiVersion']}")
    return errors


def test_every_document_matches_the_kubernetes_schema(repo: Path) -> None:
    errors = []
    for name, documents in manifests(repo).items():
        for doc in documents:
            if doc["kind"] == "RayCluster":
                errors += [f"{name} RayCluster: {e}" for e in _ray_cluster_errors(doc)]
            for checked in _as_kubernetes(doc):
                try:
                    kubernetes_validate.validate(checked, KUBERNETES, strict=True)
                except kubernetes_validate.ValidationError as exc:
                    errors.append(f"{name} {checked['kind']} {checked['metadata']['name']}: {exc.message}")
    assert not errors, "\n".join(errors)


def test_every_workload_keeps_the_policy_and_all_traffic_starts_denied(repo: Path) -> None:
    files = manifests(repo)
    found = [v for documents in files.values() for v in violations(documents)]
    assert not found, "\n".join(found)
    deny = next(d for d in files["config.yaml"] if d["metadata"]["name"] == "crucible-default-deny")
    assert deny["spec"]["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "crucible"}
    assert set(deny["spec"]["policyTypes"]) == {"Ingress", "Egress"} and "egress" not in deny["spec"]


def _lacking(documents: list[dict[str, Any]], edit) -> list[str]:
    changed = copy.deepcopy(documents)
    deployment = next(d for d in changed if d["kind"] == "Deployment")
    edit(deployment["spec"]["template"]["spec"], changed)
    return violations(changed)


CUTS = {
    "a service-account token": lambda pod, docs: pod.pop("automountServiceAccountToken"),
    "resource requests": lambda pod, docs: pod["containers"][0]["resources"].pop("requests"),
    "a memory limit": lambda pod, docs: pod["containers"][0]["resources"].pop("limits"),
    "privilege escalation": lambda pod, docs: pod["containers"][0]["securityContext"].pop(
        "allowPrivilegeEscalation"
    ),
    "dropped capabilities": lambda pod, docs: pod["containers"][0]["securityContext"].pop("capabilities"),
    "a read-only root": lambda pod, docs: pod["containers"][0]["securityContext"].pop(
        "readOnlyRootFilesystem"
    ),
    "a non-root user": lambda pod, docs: pod["securityContext"].pop("runAsNonRoot"),
    "seccomp": lambda pod, docs: pod["securityContext"].pop("seccompProfile"),
    "the disruption budget": lambda pod, docs: docs.remove(
        next(d for d in docs if d["kind"] == "PodDisruptionBudget")
    ),
    "the network policy": lambda pod, docs: docs.remove(
        next(d for d in docs if d["kind"] == "NetworkPolicy")
    ),
}


@pytest.mark.parametrize("cut", CUTS)
def test_the_policy_fails_a_manifest_without_each_rule(repo: Path, cut: str) -> None:
    grader = manifests(repo)["grader.yaml"]
    assert violations(grader) == []
    assert _lacking(grader, CUTS[cut]), cut


def test_the_sandbox_exception_is_its_documented_one_and_no_more(repo: Path) -> None:
    sandbox = manifests(repo)["sandbox.yaml"]
    assert violations(sandbox) == []
    more = _lacking(
        sandbox,
        lambda pod, docs: pod["containers"][0]["securityContext"]["capabilities"]["add"].append("NET_ADMIN"),
    )
    assert more == ["sandbox/sandbox: the sandbox adds capabilities beyond SYS_ADMIN"]
    loose = _lacking(sandbox, lambda pod, docs: pod.pop("nodeSelector"))
    assert loose == ["sandbox: the sandbox is not confined to its node pool"]


def test_the_ray_cluster_is_checked_as_strictly_as_a_deployment(repo: Path) -> None:
    documents = copy.deepcopy(manifests(repo)["trainer-ray.yaml"])
    ray = next(d for d in documents if d["kind"] == "RayCluster")
    worker = ray["spec"]["workerGroupSpecs"][0]
    container = worker["template"]["spec"]["containers"][0]
    assert not violations(documents) and not _ray_cluster_errors(ray)
    container["securityContext"].pop("readOnlyRootFilesystem")
    container["resourcez"] = {}
    worker["replicas"] = 99
    ray["spec"]["autoscalerOptionz"] = {}
    assert "crucible-ray/gpu/ray-worker: the root filesystem is writable" in violations(documents)
    assert len(_ray_cluster_errors(ray)) == 2
    with pytest.raises(kubernetes_validate.ValidationError, match="resourcez"):
        for checked in _as_kubernetes(ray):
            kubernetes_validate.validate(checked, KUBERNETES, strict=True)
