"""The Pod Security Standards' "restricted" profile, checked field by field on a pod's manifest:
what Pod Security Admission refuses in a namespace labelled ``pod-security.kubernetes.io/enforce:
restricted``. Written from the published standard
(https://kubernetes.io/docs/concepts/security/pod-security-standards/, the profile as of
Kubernetes 1.30: every Baseline control, then the Restricted ones); the test API server (v1.20)
has no such admission to ask.

``restricted_violations(pod)`` names each offending field; ``[]`` is a pod the profile admits.
"""

from __future__ import annotations

from typing import Any

# Baseline, "Sysctls": the safe set.
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
# Baseline, "SELinux": the types allowed (user and role must be unset).
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Restricted, "Volume Types": the only kinds of volume allowed.
VOLUME_TYPES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
}
SECCOMP_TYPES = {"RuntimeDefault", "Localhost"}
APPARMOR_TYPES = {"RuntimeDefault", "Localhost"}


def restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The fields of ``pod`` (a Pod's ``metadata`` and ``spec``, or a pod template) that the
    restricted profile forbids, as paths; ``[]`` when it admits the pod."""
    spec = pod["spec"]
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    pod_sc = spec.get("securityContext") or {}
    containers = [
        (f"spec.{kind}[{c['name']}]", c, c.get("securityContext") or {})
        for kind in ("containers", "initContainers", "ephemeralContainers")
        for c in spec.get(kind) or []
    ]
    found: list[str] = []

    # --- Baseline ---
    # HostProcess: Windows host-process containers.
    if (pod_sc.get("windowsOptions") or {}).get("hostProcess"):
        found.append("spec.securityContext.windowsOptions.hostProcess")
    # Host namespaces.
    found += [f"spec.{name}" for name in ("hostNetwork", "hostPID", "hostIPC") if spec.get(name)]
    # AppArmor: the annotation (before 1.30) and the field.
    for key, value in annotations.items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            found.append(f"metadata.annotations[{key}]")
    if "appArmorProfile" in pod_sc and pod_sc["appArmorProfile"].get("type") not in APPARMOR_TYPES:
        found.append("spec.securityContext.appArmorProfile.type")
    # SELinux.
    found += _selinux("spec.securityContext", pod_sc)
    # Sysctls.
    found += [
        f"spec.securityContext.sysctls[{s['name']}]"
        for s in pod_sc.get("sysctls") or []
        if s["name"] not in SAFE_SYSCTLS
    ]
    for where, container, sc in containers:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            found.append(f"{where}.securityContext.windowsOptions.hostProcess")
        # Privileged containers.
        if sc.get("privileged"):
            found.append(f"{where}.securityContext.privileged")
        # Host ports.
        found += [
            f"{where}.ports[{i}].hostPort"
            for i, port in enumerate(container.get("ports") or [])
            if port.get("hostPort")
        ]
        if "appArmorProfile" in sc and sc["appArmorProfile"].get("type") not in APPARMOR_TYPES:
            found.append(f"{where}.securityContext.appArmorProfile.type")
        found += _selinux(f"{where}.securityContext", sc)
        # /proc mount type.
        if sc.get("procMount") not in (None, "Default"):
            found.append(f"{where}.securityContext.procMount")

    # --- Restricted ---
    # Volume types (hostPath among the forbidden ones).
    for volume in spec.get("volumes") or []:
        found += [f"spec.volumes[{volume['name']}].{kind}" for kind in sorted(set(volume) - {"name"} - VOLUME_TYPES)]
    # Running as non-root: the pod says so, or every container does; none may say otherwise.
    if pod_sc.get("runAsNonRoot") is False:
        found.append("spec.securityContext.runAsNonRoot")
    # Running as non-root user: a uid, where given, is not 0.
    if pod_sc.get("runAsUser") == 0:
        found.append("spec.securityContext.runAsUser")
    # Seccomp: RuntimeDefault or Localhost, on the pod or on every container; Unconfined nowhere.
    pod_seccomp = (pod_sc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_TYPES:
        found.append("spec.securityContext.seccompProfile.type")
    for where, _, sc in containers:
        # Privilege escalation: must be set to false.
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{where}.securityContext.allowPrivilegeEscalation")
        if sc.get("runAsNonRoot") is False or (
            sc.get("runAsNonRoot") is None and pod_sc.get("runAsNonRoot") is not True
        ):
            found.append(f"{where}.securityContext.runAsNonRoot")
        if sc.get("runAsUser") == 0:
            found.append(f"{where}.securityContext.runAsUser")
        seccomp = (sc.get("seccompProfile") or {}).get("type")
        if (seccomp is not None and seccomp not in SECCOMP_TYPES) or (
            seccomp is None and pod_seccomp not in SECCOMP_TYPES
        ):
            found.append(f"{where}.securityContext.seccompProfile.type")
        # Capabilities: ALL dropped; only NET_BIND_SERVICE may be added back.
        capabilities = sc.get("capabilities") or {}
        if "ALL" not in (capabilities.get("drop") or []):
            found.append(f"{where}.securityContext.capabilities.drop")
        if set(capabilities.get("add") or []) - {"NET_BIND_SERVICE"}:
            found.append(f"{where}.securityContext.capabilities.add")
    return found


def _selinux(where: str, sc: dict[str, Any]) -> list[str]:
    options = sc.get("seLinuxOptions") or {}
    found = [f"{where}.seLinuxOptions.{key}" for key in ("user", "role") if options.get(key)]
    if options.get("type", "") not in SELINUX_TYPES:
        found.append(f"{where}.seLinuxOptions.type")
    return found
