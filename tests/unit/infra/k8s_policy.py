"""The hardening every Crucible workload on Kubernetes keeps, as a check that names what a manifest lacks.

Each pod: no service-account token, resources requested (cpu, memory) and memory bounded, a read-only
root filesystem, and, except the sandbox, no privilege escalation, every capability dropped, a non-root
user and the runtime's default seccomp profile. The sandbox's exception is exactly its documented one
(CAP_SYS_ADMIN as root, seccomp and AppArmor unconfined) and it runs on its own node pool. Each
Deployment has a PodDisruptionBudget and a NetworkPolicy of its own for ingress and egress; the pods of
a KubeRay RayCluster keep the same pod rules and have their NetworkPolicy.
"""

from __future__ import annotations

from typing import Any

SANDBOX_POOL = {"crucible.dev/pool": "sandbox"}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= labels.items()


def pod_violations(name: str, pod: dict[str, Any], *, sandbox: bool = False) -> list[str]:
    found = []
    if pod.get("automountServiceAccountToken") is not False:
        found.append(f"{name}: automountServiceAccountToken is not false")
    pod_security = pod.get("securityContext") or {}
    for container in pod.get("containers", []):
        where = f"{name}/{container.get('name')}"
        resources = container.get("resources") or {}
        for kind, key in (("requests", "cpu"), ("requests", "memory"), ("limits", "memory")):
            if key not in (resources.get(kind) or {}):
                found.append(f"{where}: no resources.{kind}.{key}")
        security = container.get("securityContext") or {}
        if security.get("readOnlyRootFilesystem") is not True:
            found.append(f"{where}: the root filesystem is writable")
        capabilities = security.get("capabilities") or {}
        if sandbox:
            if capabilities.get("add") != ["SYS_ADMIN"]:
                found.append(f"{where}: the sandbox adds capabilities beyond SYS_ADMIN")
            continue
        if security.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}: allowPrivilegeEscalation is not false")
        if "ALL" not in (capabilities.get("drop") or []) or capabilities.get("add"):
            found.append(f"{where}: capabilities are not all dropped")
        if not (security.get("runAsNonRoot") or pod_security.get("runAsNonRoot")):
            found.append(f"{where}: may run as root")
        seccomp = security.get("seccompProfile") or pod_security.get("seccompProfile") or {}
        if seccomp.get("type") != "RuntimeDefault":
            found.append(f"{where}: no RuntimeDefault seccomp profile")
    if sandbox:
        if (pod.get("nodeSelector") or {}) != SANDBOX_POOL:
            found.append(f"{name}: the sandbox is not confined to its node pool")
        if not any(
            t.get("key") == "crucible.dev/pool" and t.get("value") == "sandbox"
            for t in pod.get("tolerations", [])
        ):
            found.append(f"{name}: the sandbox does not tolerate its pool's taint")
    return found


def ray_pod_templates(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """A KubeRay RayCluster's pod templates by group: the head's and each worker group's."""
    spec = doc["spec"]
    groups = {"head": spec["headGroupSpec"]}
    groups.update({g["groupName"]: g for g in spec.get("workerGroupSpecs", [])})
    return {name: group["template"] for name, group in groups.items()}


def violations(documents: list[dict[str, Any]]) -> list[str]:
    """What the documents of one file lack."""
    found = []
    budgets = [d for d in documents if d["kind"] == "PodDisruptionBudget"]
    policies = [d for d in documents if d["kind"] == "NetworkPolicy"]
    for doc in documents:
        if doc["kind"] == "RayCluster":
            for group, template in ray_pod_templates(doc).items():
                name = f"{doc['metadata']['name']}/{group}"
                found += pod_violations(name, template["spec"])
                if not any(
                    _selects(p["spec"]["podSelector"], template["metadata"]["labels"])
                    and {"Ingress", "Egress"} <= set(p["spec"]["policyTypes"])
                    for p in policies
                ):
                    found.append(f"{name}: no NetworkPolicy of its own for ingress and egress")
            continue
        if doc["kind"] not in ("Deployment", "Job"):
            continue
        name = doc["metadata"]["name"]
        template = doc["spec"]["template"]
        found += pod_violations(
            name, template["spec"], sandbox=doc["kind"] == "Deployment" and name == "sandbox"
        )
        if doc["kind"] != "Deployment":
            continue
        labels = template["metadata"]["labels"]
        if not any(_selects(b["spec"]["selector"], labels) for b in budgets):
            found.append(f"{name}: no PodDisruptionBudget")
        if not any(
            _selects(p["spec"]["podSelector"], labels)
            and {"Ingress", "Egress"} <= set(p["spec"]["policyTypes"])
            for p in policies
        ):
            found.append(f"{name}: no NetworkPolicy of its own for ingress and egress")
    return found
