"""Deploy: Dockerfile, Kubernetes sidecar + kustomization, PodMonitor, PrometheusRule, compose stack."""
import glob
import os
import re
import shlex
import shutil
import subprocess
import tomllib
import urllib.request

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.conftest import REPO, free_port, mounted_tmpfs, needs_root
from tests.data.prometheus_operator_schemas import SCHEMAS

DEPLOY = os.path.join(REPO, "deploy")
SIDECAR = os.path.join(DEPLOY, "kubernetes", "sidecar")
K8S_VERSION = "1.30"


def tool(name):
    return shutil.which(name) or pytest.fail(f"{name} is not installed (.ci/run installs it)")


def documents(path):
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def kustomize_patches():
    """Files a kustomization applies as patches: partial objects, validated once rendered."""
    out = set()
    for path in glob.glob(os.path.join(DEPLOY, "kubernetes", "**", "kustomization.yaml"), recursive=True):
        for patch in documents(path)[0].get("patches", []):
            if "path" in patch:
                out.add(os.path.normpath(os.path.join(os.path.dirname(path), patch["path"])))
    return out


def all_manifests():
    out = []
    patches = kustomize_patches()
    for path in sorted(glob.glob(os.path.join(DEPLOY, "kubernetes", "**", "*.yaml"), recursive=True)):
        if os.path.normpath(path) in patches:
            continue
        for doc in documents(path):
            if doc.get("kind") != "Kustomization":
                out.append((os.path.relpath(path, REPO), doc))
    return out


@pytest.mark.parametrize("path,doc", all_manifests(), ids=lambda v: v if isinstance(v, str) else "")
def test_manifest_validates(path, doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in SCHEMAS:
        jsonschema.validate(doc, SCHEMAS[key])
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize("directory,kinds", [
    ("sidecar", ["Deployment", "PodMonitor", "PrometheusRule", "PrometheusRule", "PrometheusRule", "Service"]),
    ("sidecar-nonroot", ["Deployment", "PodMonitor", "PrometheusRule", "PrometheusRule", "PrometheusRule",
                         "Service"]),
    ("daemonset", ["DaemonSet", "PodMonitor"] + ["PrometheusRule"] * 4),
    ("daemonset-privileged", ["DaemonSet", "PodMonitor"] + ["PrometheusRule"] * 4),
])
def test_kustomize_renders_everything(directory, kinds):
    path = os.path.join(DEPLOY, "kubernetes", directory)
    result = subprocess.run([tool("kubectl"), "kustomize", path], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert sorted(d["kind"] for d in yaml.safe_load_all(result.stdout) if d) == kinds


def test_daemonset_reads_the_host_read_only():
    ds = next(d for d in documents(os.path.join(DEPLOY, "kubernetes", "daemonset", "daemonset.yaml")))
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] is True and spec["tolerations"] and spec["nodeSelector"]
    container = spec["containers"][0]
    assert "--mode=node" in container["args"] and "--path.rootfs=/host" in container["args"]
    assert all(m["readOnly"] for m in container["volumeMounts"])
    ctx = container["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"]
    assert ctx["capabilities"]["drop"] == ["ALL"] and set(ctx["capabilities"]["add"]) == {"SYS_PTRACE",
                                                                                         "DAC_READ_SEARCH"}
    assert container["resources"]["limits"]["memory"]
    assert "--no-collector.oom" in container["args"]  # /dev/kmsg needs the privileged variant


def test_daemonset_privileged_reads_the_kernel_log():
    """The explicit choice: privileged (the runtime's device cgroup admits /dev/kmsg to
    nothing less), the device read-only, and the oom collector on."""
    result = subprocess.run([tool("kubectl"), "kustomize", os.path.join(DEPLOY, "kubernetes", "daemonset-privileged")],
                            capture_output=True, text=True, timeout=60)
    ds = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert "--no-collector.oom" not in container["args"] and "--mode=node" in container["args"]
    assert container["securityContext"]["privileged"] is True
    kmsg = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/kmsg")
    assert kmsg["readOnly"] and all(m["readOnly"] for m in container["volumeMounts"])
    volume = next(v for v in spec["volumes"] if v["name"] == kmsg["name"])
    assert volume["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    kubernetes_validate.validate(ds, K8S_VERSION, strict=True)


def test_yamllint_clean():
    # Relative paths: .yamllint.yml's ignore patterns are relative to the repository.
    result = subprocess.run([tool("yamllint"), "-s", "-c", ".yamllint.yml", "deploy", "grafana/provisioning",
                             ".yamllint.yml"], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_clean():
    result = subprocess.run([tool("hadolint"), os.path.join(REPO, "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_prometheus_config_is_valid():
    result = subprocess.run([tool("promtool"), "check", "config", os.path.join(DEPLOY, "prometheus", "prometheus.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def pod_spec():
    deployment = next(d for d in documents(os.path.join(SIDECAR, "deployment.yaml")) if d["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]


def test_sidecar_is_safe_and_wired_to_the_workload():
    spec = pod_spec()
    assert spec["shareProcessNamespace"] is True
    containers = {c["name"]: c for c in spec["containers"]}
    sidecar, server = containers["shmwatch"], containers["vllm"]
    volume = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert volume["emptyDir"]["medium"] == "Memory"
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == "dshm")
    assert mount["readOnly"] is True and mount["mountPath"] == "/dev/shm"
    assert any(m["name"] == "dshm" and m["mountPath"] == "/dev/shm" for m in server["volumeMounts"])
    ctx = sidecar["securityContext"]
    assert ctx["readOnlyRootFilesystem"] and not ctx["allowPrivilegeEscalation"] and ctx["capabilities"]["drop"] == ["ALL"]
    # The server runs as its image's user (vLLM's is root): nothing forces a UID on it.
    assert "runAsUser" not in spec.get("securityContext", {}) and "runAsUser" not in server.get("securityContext", {})
    env = {e["name"]: e for e in sidecar["env"]}
    ref = env["SHMWATCH_MEMORY_LIMIT_BYTES"]["valueFrom"]["resourceFieldRef"]
    assert ref == {"containerName": "vllm", "resource": "limits.memory"}
    size_flag = next(a for a in sidecar["args"] if a.startswith("--shm.size-limit="))
    assert size_flag.split("=", 1)[1] == volume["emptyDir"]["sizeLimit"]
    assert sidecar["ports"][0]["name"] == "metrics" and sidecar["resources"]["limits"]["memory"]


def rendered_pod_spec(directory):
    result = subprocess.run([tool("kubectl"), "kustomize", os.path.join(DEPLOY, "kubernetes", directory)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    deployment = next(d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Deployment")
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)  # patched: valid as a whole
    return deployment["spec"]["template"]["spec"]


@pytest.mark.parametrize("directory", ["sidecar", "sidecar-nonroot"])
def test_sidecar_variants_can_read_the_server(directory):
    """Owners come from /proc/<pid>/maps and fd, which need ptrace access: the kernel grants
    it to the same UID when the reader's capabilities cover the target's (a non-root server
    has none), or with SYS_PTRACE. tests/containers/test_kubernetes.py runs both for real."""
    spec = rendered_pod_spec(directory)
    containers = {c["name"]: c for c in spec["containers"]}

    def context(name):
        return {**spec.get("securityContext", {}), **containers[name].get("securityContext", {})}
    sidecar, server = context("shmwatch"), context("vllm")
    server_uid = server.get("runAsUser", 0)  # vLLM's image runs as root
    added = set(sidecar["capabilities"].get("add") or [])
    assert added <= {"SYS_PTRACE"} and sidecar["capabilities"]["drop"] == ["ALL"]
    assert sidecar["readOnlyRootFilesystem"] and sidecar["allowPrivilegeEscalation"] is False
    assert sidecar.get("runAsUser") == server_uid and (server_uid != 0 or "SYS_PTRACE" in added)
    if server_uid != 0:  # a non-root server keeps a writable HOME and cache directory
        env = {e["name"]: e.get("value") for e in containers["vllm"]["env"]}
        mounts = {m["mountPath"] for m in containers["vllm"]["volumeMounts"]}
        assert env["HOME"] in mounts and env["XDG_CACHE_HOME"].startswith(env["HOME"])
        # and the pod fits Pod Security "restricted" (which is why this variant exists).
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        for c in spec["containers"] + spec.get("initContainers", []):
            ctx = {**spec["securityContext"], **c.get("securityContext", {})}
            assert ctx["runAsNonRoot"] and ctx["allowPrivilegeEscalation"] is False, c["name"]
            assert ctx["capabilities"]["drop"] == ["ALL"] and not ctx["capabilities"].get("add"), c["name"]
    images = {c["image"] for c in spec["containers"] + spec.get("initContainers", []) if "vllm" not in c["image"]}
    assert images == {"registry.example.com/shmwatch:0.1.0"}  # kustomization.yaml's images: entry


def dockerfile():
    with open(os.path.join(REPO, "Dockerfile")) as f:
        text = f.read().replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


def test_dockerfile_runs_as_non_root_and_exposes_the_port():
    users = [line.split(None, 1)[1] for line in dockerfile() if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "EXPOSE 9841" in dockerfile()
    assert 'ENTRYPOINT ["shmwatch"]' in dockerfile()


@needs_root
def test_dockerfile_steps_build_a_working_exporter():
    """Replays the Dockerfile's COPY and RUN steps in a fresh virtualenv of Debian's own
    Python (no Docker engine here; pip fetches the dependencies from PyPI as `docker build`
    does), then runs the result as the Dockerfile's USER from a read-only install."""
    import pathlib
    import tempfile
    base = "/usr/bin/python3"  # world-readable, unlike a pyenv under /root
    if not os.path.exists(base):
        pytest.fail("needs Debian's python3 (package python3) with venv")
    tmp_path = pathlib.Path(tempfile.mkdtemp(prefix="shmwatch-image-"))
    os.chmod(tmp_path, 0o755)
    context, root = REPO, tmp_path / "image"
    venv = root / "venv"
    subprocess.run([base, "-m", "venv", str(venv)], check=True)
    workdir = root
    for line in dockerfile():
        op, _, arg = line.partition(" ")
        if op == "WORKDIR":
            workdir = root / arg.lstrip("/")
            workdir.mkdir(parents=True, exist_ok=True)
        elif op == "COPY":
            *sources, dest = shlex.split(arg)
            target = workdir / dest if not dest.startswith("/") else root / dest.lstrip("/")
            for source in sources:
                src = os.path.join(context, source)
                if os.path.isdir(src):
                    shutil.copytree(src, target / os.path.basename(source.rstrip("/")) if dest.endswith("/")
                                    else target, dirs_exist_ok=True)
                else:
                    target.mkdir(parents=True, exist_ok=True)
                    shutil.copy(src, target)
        elif op == "RUN":
            command = arg.replace("python3 ", f"{venv / 'bin' / 'python3'} ").replace("/src", str(root / "src"))
            done = subprocess.run(command, shell=True, cwd=workdir, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert not (root / "src").exists()  # the build context is removed, as in the image
    user = next(line.split()[1] for line in reversed(dockerfile()) if line.startswith("USER "))
    uid, gid = (int(x) for x in user.split(":"))
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)
    subprocess.run(["chmod", "-R", "a-w", str(root)], check=True)  # a read-only root filesystem
    shmwatch = str(venv / "bin" / "shmwatch")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "PYTHONDONTWRITEBYTECODE": "1"}
    # The checkout is gone (rm -rf /src): the version is the one pip wrote into the metadata.
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]
    printed = subprocess.run([shmwatch, "--version"], env=env, cwd="/", user=uid, group=gid, capture_output=True,
                             text=True, timeout=30)
    assert printed.stdout == f"shmwatch {version}\n", printed.stdout + printed.stderr
    with mounted_tmpfs("16m") as shm:
        proc = subprocess.Popen([shmwatch, f"--web.listen-address=127.0.0.1:{port}", f"--shm.mount={shm}",
                                 "--no-collector.gpu"], env=env, cwd="/", user=uid, group=gid,
                                stderr=subprocess.PIPE)
        try:
            text = ""
            for _ in range(100):
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                        text = r.read().decode()
                    if "shmwatch_mount_size_bytes" in text:
                        break
                except OSError:
                    pass
                import time
                time.sleep(0.1)
            assert re.search(rf'shmwatch_mount_size_bytes{{mount="{shm}"}} 1\.6777216e\+07', text), \
                text[-1000:] + proc.stderr.read1().decode() if proc.poll() is not None else text[-2000:]
            assert f'shmwatch_build_info{{version="{version}"}} 1.0' in text, text[:1000]
        finally:
            proc.terminate()
            proc.wait(10)
    subprocess.run(["chmod", "-R", "u+w", str(root)], check=True)
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_compose_stack_is_wired():
    with open(os.path.join(DEPLOY, "docker-compose.yml")) as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    assert {"workload", "vllm", "shmwatch", "prometheus", "alertmanager", "grafana"} <= set(services)
    shm = services["shmwatch"]
    assert shm["ipc"] == "service:workload" and shm["pid"] == "service:workload" and shm["read_only"] is True
    assert services["workload"]["shm_size"] and services["vllm"]["shm_size"] == "16gb"
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert os.path.exists(os.path.join(DEPLOY, source)), f"{name}: {source} does not exist"
