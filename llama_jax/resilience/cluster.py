"""What the cluster learns from a pre-flight verdict: keep the job off the nodes it named, without a person.

On Kubernetes (launch/k8s.sh) the supervisor in each pod labels every node named in <run.dir>/unhealthy.json
with LABEL_ENV's label (llama-jax.io/unhealthy=true), through the API server, with the pod's service account
(k8s.sh's manifest grants it get and patch on nodes); the Job's node affinity then keeps the replacement pods
off them. Slurm needs nothing here: launch/slurm.sbatch resubmits the job excluding the nodes.

The request is a JSON merge patch of the node's labels, with the standard library's HTTP client: the API
server is https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT with the service account's token and
CA, or LLAMA_JAX_K8S_API (a URL; plain http for a proxy such as `kubectl proxy`).
"""

from __future__ import annotations

import json
import os
import ssl
import urllib.error
import urllib.request
from pathlib import Path

LABEL_ENV = "LLAMA_JAX_LABEL_UNHEALTHY_NODES"  # the label key=value to set; k8s.sh sets it
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def unhealthy_hosts(verdict: Path) -> list[str]:
    """The hosts a pre-flight verdict file names ([] when it is missing or unreadable)."""
    try:
        return [str(h) for h in json.loads(verdict.read_text())["hosts"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def label_nodes(nodes: list[str], label: str, timeout_s: float = 10.0) -> list[str]:
    """Label each node (`key=value`) through the Kubernetes API; one line per node saying what happened."""
    key, _, value = label.partition("=")
    api, headers, context = _api()
    if api is None:
        return [
            f"cannot label {', '.join(nodes)}: no Kubernetes API server here (set LLAMA_JAX_K8S_API, or run in a "
            f"pod); label by hand: kubectl label node NODE {label}"
        ]
    lines = []
    for node in nodes:
        body = json.dumps({"metadata": {"labels": {key: value or "true"}}}).encode()
        request = urllib.request.Request(
            f"{api}/api/v1/nodes/{node}",
            data=body,
            method="PATCH",
            headers={**headers, "Content-Type": "application/merge-patch+json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s, context=context) as reply:
                reply.read()
            lines.append(f"labelled node {node} {key}={value or 'true'}: the job's pods stay off it")
        except (urllib.error.URLError, OSError) as err:  # HTTPError (403: no permission) is a URLError
            lines.append(f"could not label node {node} ({err}); label it by hand: kubectl label node {node} {label}")
    return lines


def _api() -> tuple[str | None, dict, ssl.SSLContext | None]:
    """(server URL, headers, TLS context) of the Kubernetes API: LLAMA_JAX_K8S_API, else in-cluster."""
    token_file = SERVICE_ACCOUNT / "token"
    headers = {"Authorization": f"Bearer {token_file.read_text().strip()}"} if token_file.is_file() else {}
    if os.environ.get("LLAMA_JAX_K8S_API"):
        return os.environ["LLAMA_JAX_K8S_API"].rstrip("/"), headers, None
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        return None, headers, None
    ca = SERVICE_ACCOUNT / "ca.crt"
    context = ssl.create_default_context(cafile=str(ca) if ca.is_file() else None)
    return f"https://{host}:{port}", headers, context
