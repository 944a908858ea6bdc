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
from k8s_policy import violations

KUBERNETES = "1.33"


def manifests(repo: Path) -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
        for path in sorted((repo / "infra" / "k8s").glob("*.yaml"))
    }


def test_every_document_matches_the_kubernetes_schema(repo: Path) -> None:
    errors = []
    for name, documents in manifests(repo).items():
        for doc in documents:
            try:
                kubernetes_validate.validate(doc, KUBERNETES, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{name} {doc['kind']} {doc['metadata']['name']}: {exc.message}")
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
    "privilege escalation": lambda pod, docs: pod["containers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
    "dropped capabilities": lambda pod, docs: pod["containers"][0]["securityContext"].pop("capabilities"),
    "a read-only root": lambda pod, docs: pod["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
    "a non-root user": lambda pod, docs: pod["securityContext"].pop("runAsNonRoot"),
    "seccomp": lambda pod, docs: pod["securityContext"].pop("seccompProfile"),
    "the disruption budget": lambda pod, docs: docs.remove(next(d for d in docs if d["kind"] == "PodDisruptionBudget")),
    "the network policy": lambda pod, docs: docs.remove(next(d for d in docs if d["kind"] == "NetworkPolicy")),
}  # fmt: skip


@pytest.mark.parametrize("cut", CUTS)
def test_the_policy_fails_a_manifest_without_each_rule(repo: Path, cut: str) -> None:
    grader = manifests(repo)["grader.yaml"]
    assert violations(grader) == []
    assert _lacking(grader, CUTS[cut]), cut


def test_the_sandbox_exception_is_its_documented_one_and_no_more(repo: Path) -> None:
    sandbox = manifests(repo)["sandbox.yaml"]
    assert violations(sandbox) == []
    more = _lacking(sandbox, lambda pod, docs: pod["containers"][0]["securityContext"]["capabilities"]["add"].append("NET_ADMIN"))
    assert more == ["sandbox/sandbox: the sandbox adds capabilities beyond SYS_ADMIN"]
    loose = _lacking(sandbox, lambda pod, docs: pod.pop("nodeSelector"))
    assert loose == ["sandbox: the sandbox is not confined to its node pool"]
