"""The Kubernetes sidecar manifests, as written, give full attribution: each variant's
securityContexts (rendered by `kubectl kustomize`) are turned into the docker flags that
mean the same, for the server and for the sidecar, and run in the container tier.

- deploy/kubernetes/sidecar: the server as its image's user (root, as vLLM's image), the
  sidecar root with every capability dropped but SYS_PTRACE;
- deploy/kubernetes/sidecar-nonroot: the server at UID 1000 (HOME and caches on a volume),
  the sidecar at the same UID with no capability.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Dict, List

import pytest
import yaml

from tests.conftest import REPO
from tests.containers.conftest import Server, assert_full_attribution, view

# The first test of the session also waits for the base image and the project image.
pytestmark = pytest.mark.timeout(600)

KUBERNETES = os.path.join(REPO, "deploy", "kubernetes")
VARIANTS = {"sidecar": 0, "sidecar-nonroot": 1000}  # -> the UID the server runs as


def rendered_pod(variant: str) -> Dict:
    kubectl = shutil.which("kubectl") or pytest.fail("kubectl is not installed (.ci/run installs it)")
    done = subprocess.run([kubectl, "kustomize", os.path.join(KUBERNETES, variant)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    deployment = next(d for d in yaml.safe_load_all(done.stdout) if d and d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def docker_flags(pod: Dict, container: Dict) -> List[str]:
    """What a container's securityContext (over the pod's) means to `docker run`. Kubernetes'
    default capabilities, seccomp RuntimeDefault and a read-write root are Docker's defaults."""
    pod_ctx = pod.get("securityContext", {})
    ctx = {**pod_ctx, **container.get("securityContext", {})}
    flags = []
    if "runAsUser" in ctx:
        flags += ["--user", f"{ctx['runAsUser']}" + (f":{ctx['runAsGroup']}" if "runAsGroup" in ctx else "")]
    if "fsGroup" in pod_ctx:
        flags += ["--group-add", str(pod_ctx["fsGroup"])]
    caps = ctx.get("capabilities") or {}
    flags += [f"--cap-drop={c}" for c in caps.get("drop") or []]
    flags += [f"--cap-add={c}" for c in caps.get("add") or []]
    if ctx.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if ctx.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    return flags


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sidecar_manifest_as_written_attributes_every_segment(images, variant):
    pod = rendered_pod(variant)
    containers = {c["name"]: c for c in pod["containers"]}
    sidecar = containers["shmwatch"]
    with Server(tag="k", run=docker_flags(pod, containers["vllm"])) as server:
        assert server.info["uid"] == VARIANTS[variant]
        text, report, _ = view(server, variant, docker_flags(pod, sidecar), args=sidecar["args"])
        assert_full_attribution(server, text, report)
