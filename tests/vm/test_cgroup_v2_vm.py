"""The cgroup v2 tier: shmwatch against real v2 pod slices, in a Debian bookworm VM (kernel 6.1,
systemd, cgroup v2 only) booted under QEMU by tests/vm/cgroup2-vm.sh. The VM has no network: a
wheelhouse (shmwatch built from this tree, its dependencies for the VM's Python 3.11) goes in
with tests/vm/scenario.py, which acts and records; the assertions are here. The project's image
(the container tier's build of the Dockerfile) goes in too, for the sidecar containers: see
project_image() for how, and why not a plain `docker load` of all of it.

Runs under CI (CI=true, where a VM that cannot boot is a failure) or with SHMWATCH_VM=1: it takes
minutes (image build ~2 min once, cached in /var/tmp/cgroup2-vm; boot and scenario ~3-5 min on
an emulated CPU).
"""

import contextlib
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib

import pytest

from tests.conftest import (
    REPO,
    UNDER_CI,
    needs_root,
    parse_exposition,
    prerequisite_missing,
    select,
    stop_process,
    value,
)

MiB = 1 << 20
VM = os.path.join(REPO, "tests", "vm")
UID = "5e1f0c2a-7b3d-4e8f-9a6b-1c2d3e4f5a6b"  # as in scenario.py
POD = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + UID.replace("-", "_") + ".slice"
SCOPE = POD + "/cri-containerd-" + "ab" * 32 + ".scope"
UID2 = "6f2a1d3b-8c4e-4f9a-8b7c-2d3e4f5a6b7c"  # the docker step's pods
UID3 = "7a3b2e4c-9d5f-4a0b-9c7d-3e4f5a6b7c8d"
DSHM = f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/dshm"
# What the VM's Python (bookworm: 3.11) needs beside shmwatch: pyproject's dependencies, read
# from it (a copy here went stale when h11 was added, and the exporter in the VM failed to start).
with open(os.path.join(REPO, "pyproject.toml"), "rb") as _pyproject:
    DEPS = tomllib.load(_pyproject)["project"]["dependencies"]
WHEEL_CACHE = "/var/tmp/shmwatch-vm-wheels"
# The last run's results, scrapes and logs: outside pytest's temporary directories, which
# another pytest run on the machine may rotate away during the minutes the VM takes.
OUT = "/var/tmp/shmwatch-vm-out"
# The first test's timeout covers the VM's boot and the scenario (the module's fixture).
pytestmark = pytest.mark.timeout(2400)
CMD = """set -eu
mkdir -p /opt/shmwatch
for w in /io/extra/wheels/*.whl; do python3 -m zipfile -e "$w" /opt/shmwatch; done
export PYTHONPATH=/opt/shmwatch
python3 /io/extra/scenario.py /io
"""


def wheelhouse(tmp_path):
    """shmwatch's wheel from this tree (built in a copy: no build/ left here), and its
    dependencies' wheels for CPython 3.11 on x86_64 (downloaded once, cached)."""
    deps = os.path.join(WHEEL_CACHE, hashlib.sha256(" ".join(DEPS).encode()).hexdigest()[:12])
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    if not os.path.isdir(deps):
        subprocess.run(
            [
                *pip,
                "download",
                "--only-binary=:all:",
                "--python-version",
                "3.11",
                "--implementation",
                "cp",
                "--platform",
                "manylinux2014_x86_64",
                "--platform",
                "manylinux_2_17_x86_64",
                "-d",
                deps + ".tmp",
                *DEPS,
            ],
            check=True,
            timeout=300,
        )
        os.rename(deps + ".tmp", deps)
    source, wheels = tmp_path / "src", tmp_path / "wheels"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source)
    shutil.copytree(
        os.path.join(REPO, "exporter"),
        source / "exporter",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    subprocess.run(
        [*pip, "wheel", "--no-deps", "-w", str(wheels), str(source)],
        check=True,
        timeout=300,
    )
    for name in os.listdir(deps):
        shutil.copy(os.path.join(deps, name), wheels)
    return wheels


DOCKER_DISKS = "/var/tmp/shmwatch-vm-docker"


def project_image(tmp):
    """The project's image (the container tier's build of the Dockerfile) for the VM, whose
    emulated CPU takes ~6 min to `docker load` its 240 MiB base layer: the base image is loaded
    on this host by a dockerd of the VM's version into a data-root that goes in as a disk (cached
    per base image); the VM `docker load`s the image's `docker save` with the base layers left
    out (its engine has them: load skips a layer it has). Returns (disk, tar, facts) or None with
    the reason when no engine can be had here."""
    from tests.containers import engine as eng

    engine = eng.Engine()
    try:
        engine.start()
    except eng.EngineUnavailable as err:
        return None, None, {"missing": str(err)}
    took = {}
    try:
        t = time.monotonic()
        if not eng.image_exists(eng.BASE_IMAGE):
            eng.build_base_image()
        eng.build_project_image()
        took["build_s"] = round(time.monotonic() - t, 1)
        inspect = {
            name: json.loads(eng.docker("image", "inspect", name).stdout)[0]
            for name in (eng.BASE_IMAGE, eng.PROJECT_IMAGE)
        }
        base_id = inspect[eng.BASE_IMAGE]["Id"].split(":")[1]
        disk = os.path.join(DOCKER_DISKS, base_id[:16] + ".img")
        if not os.path.exists(disk):
            t = time.monotonic()
            eng.docker("save", "-o", str(tmp / "base.tar"), eng.BASE_IMAGE, timeout=600)
            seed_disk(disk, tmp / "base.tar")
            took["seed_s"] = round(time.monotonic() - t, 1)
        t = time.monotonic()
        eng.docker("save", "-o", str(tmp / "full.tar"), eng.PROJECT_IMAGE, timeout=600)
        took["save_s"] = round(time.monotonic() - t, 1)
    finally:
        engine.stop()
    tar = tmp / "shmwatch-image.tar"
    base_layers = set(inspect[eng.BASE_IMAGE]["RootFS"]["Layers"])
    took["full_bytes"], took["slim_bytes"] = (
        (tmp / "full.tar").stat().st_size,
        slim_save(tmp / "full.tar", base_layers, tar),
    )
    return (
        disk,
        tar,
        dict(took, tag=eng.PROJECT_IMAGE, id=inspect[eng.PROJECT_IMAGE]["Id"]),
    )


def seed_disk(disk, base_tar):
    """An ext4 image of a docker data-root holding `base_tar`, loaded by this host's dockerd
    (Debian bookworm's 20.10, as the VM's) run on its own socket and directories."""
    os.makedirs(DOCKER_DISKS, exist_ok=True)
    root = tempfile.mkdtemp(prefix="seed-", dir=DOCKER_DISKS)
    sock = f"unix://{root}/docker.sock"
    with open(f"{root}/daemon.json", "w") as f:
        f.write("{}")
    with open(f"{root}/dockerd.log", "wb") as log:
        dockerd = subprocess.Popen(
            [
                "dockerd",
                f"--data-root={root}/data",
                f"--exec-root={root}/exec",
                f"--pidfile={root}/docker.pid",
                f"--host={sock}",
                f"--config-file={root}/daemon.json",
                "--bridge=none",
                "--iptables=false",
                "--ip-forward=false",
                "--ip-masq=false",
                "--storage-driver=overlay2",
                # Its own namespaces in a system containerd it may connect to: the engine's
                # dockerd keeps its images and containers apart.
                "--containerd-namespace=shmwatch-seed",
                "--containerd-plugins-namespace=shmwatch-seed-plugins",
            ],
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "-H", sock, "info"], capture_output=True).returncode:
            assert dockerd.poll() is None and time.monotonic() < deadline, open(f"{root}/dockerd.log").read()[-2000:]
            time.sleep(0.5)
        subprocess.run(
            ["docker", "-H", sock, "load", "-q", "-i", str(base_tar)],
            check=True,
            capture_output=True,
            timeout=600,
        )
        stop_process(dockerd, 60)
        shutil.rmtree(f"{root}/data/network", ignore_errors=True)
        subprocess.run(["truncate", "-s", "1G", disk + ".tmp"], check=True)
        subprocess.run(
            ["mkfs.ext4", "-q", "-F", "-d", f"{root}/data", disk + ".tmp"],
            check=True,
            timeout=600,
        )
        os.rename(disk + ".tmp", disk)
    finally:
        # On any failure too: no daemon (its containerd is in its session), mount or
        # half-made image is left in /var/tmp.
        stop_process(dockerd, 60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(dockerd.pid, signal.SIGKILL)
        for line in reversed(open("/proc/self/mountinfo").read().splitlines()):
            if line.split()[4].startswith(root):
                subprocess.run(["umount", "-l", line.split()[4]], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(disk + ".tmp")


def slim_save(full, base_layers, out):
    """`docker save`'s archive without the layers in `base_layers` (diff ids). Its size."""
    with tarfile.open(full) as src:
        [manifest] = json.load(src.extractfile("manifest.json"))
        config = json.load(src.extractfile(manifest["Config"]))
        dropped = {
            os.path.dirname(path)
            for path, diff in zip(manifest["Layers"], config["rootfs"]["diff_ids"])
            if diff in base_layers
        }
        with tarfile.open(out, "w") as dst:
            for member in src:
                if member.name.split("/")[0] not in dropped:
                    dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    return os.path.getsize(out)


@pytest.fixture(scope="module")
def vm_run(tmp_path_factory):
    """The scenario's results and scrapes, from one VM boot for every test here."""
    if not (UNDER_CI or os.environ.get("SHMWATCH_VM") == "1"):
        pytest.skip("the cgroup v2 VM tier runs under CI=true or with SHMWATCH_VM=1 (minutes)")
    if os.geteuid() != 0:
        prerequisite_missing("the cgroup v2 VM needs root (mmdebstrap, QEMU)")
    out = pathlib.Path(OUT)
    if os.environ.get("SHMWATCH_VM_REUSE") == "1":  # the last run's results, no boot (developing the checks)
        return (
            out,
            json.loads((out / "results.json").read_text()),
            (out / "stdout.log").read_text(),
        )
    tmp = tmp_path_factory.mktemp("cgroup2-vm")
    wheels = wheelhouse(tmp)
    disk, image, facts = project_image(tmp)
    if disk is None and UNDER_CI:
        pytest.fail(f"no container engine for the project's image: {facts['missing']}")
    (tmp / "image.json").write_text(json.dumps(facts))
    cmd = tmp / "cmd.sh"
    cmd.write_text(CMD)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, TIMEOUT="1200", **({"DISK2": disk} if disk else {}))
    extra = [
        str(wheels),
        os.path.join(VM, "scenario.py"),
        str(tmp / "image.json"),
        *([str(image)] if image else []),
    ]
    proc = subprocess.run(
        [os.path.join(VM, "cgroup2-vm.sh"), "run", str(cmd), str(out), *extra],
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    if proc.returncode in (124, 125) or not (out / "exit_code").exists():
        console = (out / "console.log").read_text(errors="replace")[-2000:] if (out / "console.log").exists() else ""
        prerequisite_missing(
            f"the cgroup v2 VM did not run the scenario (rc {proc.returncode}): {proc.stderr[-2000:]}\n{console}"
        )
    stdout = (out / "stdout.log").read_text()
    stderr = (out / "stderr.log").read_text()
    results_file = out / "results.json"
    assert results_file.exists(), f"no results from the VM (rc {proc.returncode}):\n{stdout}\n{stderr}"
    results = json.loads(results_file.read_text())
    print(stdout)  # the steps and their timings, for the report (pytest -s)
    return (
        out,
        results,
        f"VM rc {proc.returncode}\n--- stdout\n{stdout}\n--- stderr\n{stderr[-3000:]}",
    )


def scrape(out, name):
    path = out / f"{name}.prom"
    assert path.exists(), f"{name}: not scraped in the VM"
    return parse_exposition(path.read_text())


def steps(results):
    return {s["name"]: s for s in results["steps"]}


@needs_root
def test_vm_ran_on_cgroup_v2_without_errors(vm_run):
    out, results, log = vm_run
    assert results["cgroup_fs"] == "cgroup2fs", log
    assert not results["errors"], log
    docker = set() if "missing" in results["image"] else {"docker", "container_oom"}
    assert set(steps(results)) == docker | {
        "filled",
        "acceptance",
        "throttled",
        "oom",
        "lowered",
    }, log
    filled = steps(results)["filled"]
    assert filled["dd_rc"] == 0 and filled["scope_shmem"] == 150 * MiB, log


@needs_root
def test_pod_level_limit_in_host_and_node_mode(vm_run):
    """The acceptance: a pod slice with memory.max=256M, its container scope with none, 150 MiB
    in a 1 GiB emptyDir tmpfs: the limit comes from the pod, the projection is above 1, the
    effective size at most 256 MiB; memory.high on the scope is exported."""
    out, _, log = vm_run
    sidecar = scrape(out, "acceptance-host")  # --cgroup.path at the container's scope
    assert (
        value(
            sidecar,
            "shmwatch_cgroup_memory_limit_bytes",
            cgroup=SCOPE,
            limit_from="pod",
        )
        == 256 * MiB
    ), log
    assert value(sidecar, "shmwatch_shm_oom_projection_ratio", mount=DSHM, cgroup=SCOPE) > 1
    assert value(sidecar, "shmwatch_mount_effective_size_bytes", mount=DSHM) <= 256 * MiB
    assert value(sidecar, "shmwatch_cgroup_memory_high_bytes", cgroup=SCOPE) == 200 * MiB
    assert value(sidecar, "shmwatch_cgroup_memory_shmem_bytes", cgroup=SCOPE) == 150 * MiB
    # Found from the workload's process: its pod's cgroup, where the limit binds.
    target = scrape(out, "acceptance-target")
    assert value(target, "shmwatch_cgroup_memory_limit_bytes", cgroup=POD, limit_from="pod") == 256 * MiB, log
    assert value(target, "shmwatch_shm_oom_projection_ratio", mount=DSHM, cgroup=POD) > 1
    # Node mode names the pod's cgroup and emptyDir by its pod_uid (and volume), not their paths.
    node = scrape(out, "acceptance-node")
    assert value(node, "shmwatch_cgroup_memory_limit_bytes", pod_uid=UID, limit_from="pod") == 256 * MiB
    assert value(node, "shmwatch_shm_oom_projection_ratio", pod_uid=UID, volume="dshm") > 1
    assert value(node, "shmwatch_mount_effective_size_bytes", pod_uid=UID, volume="dshm") <= 256 * MiB
    assert value(node, "shmwatch_mount_used_bytes", pod_uid=UID, volume="dshm") == 150 * MiB
    assert not [k for k in node if POD in str(k) or DSHM in str(k)]


@needs_root
def test_a_writer_past_the_pod_limit_is_killed_and_counted_for_the_pod(vm_run):
    out, results, log = vm_run
    oom = steps(results)["oom"]
    assert oom["writer_rc"] == -9 and oom["holder_alive"], log  # SIGKILL, the workload spared
    node = scrape(out, "oom-node")
    assert value(node, "shmwatch_cgroup_oom_kills_total", pod_uid=UID) >= 1, log
    assert value(node, "shmwatch_cgroup_memory_events_total", pod_uid=UID, event="oom_kill") >= 1
    sidecar = scrape(out, "oom-host")
    assert (
        value(
            sidecar,
            "shmwatch_cgroup_memory_events_total",
            cgroup=SCOPE,
            event="oom_kill",
        )
        >= 1
    )


@needs_root
def test_memory_max_lowered_at_run_time_is_followed_within_a_poll(vm_run):
    """The pod's memory.max lowered to 200 MiB (an in-place resize): the limit and the effective
    size follow at the next poll (1 s; the scrape loop's 0.5 s and the emulated CPU on top)."""
    out, results, log = vm_run
    lowered = steps(results)["lowered"]
    for name in ("host", "target", "node"):
        s = scrape(out, f"lowered-{name}")
        where = {"pod_uid": UID, "volume": "dshm"} if name == "node" else {"mount": DSHM}
        assert value(s, "shmwatch_mount_effective_size_bytes", **where) <= 200 * MiB, (name, log)
    assert lowered["seconds"]["host"] <= 5, log


def image_needed(results):
    if "missing" in results["image"]:  # under CI=true the fixture has failed already
        prerequisite_missing(f"no container engine here for the project's image: {results['image']['missing']}")


@needs_root
def test_the_project_image_ran_in_the_vm(vm_run):
    """The image the container tier builds from the Dockerfile, loaded in the VM (its base
    layer from the data-root disk), is what the sidecars ran: the same image id."""
    out, results, log = vm_run
    image_needed(results)
    image = results["image"]
    assert results.get("image_loaded_id") == image["id"], log
    print(
        {k: image[k] for k in image if k.endswith(("_s", "_bytes"))},
        steps(results)["docker"],
    )


@needs_root
def test_sidecar_containers_in_a_private_cgroup_namespace(vm_run):
    """The acceptance, and tests/containers/test_memory.py's checks on v2: the project's image
    as a sidecar (Docker's v2 default, a private cgroup namespace) beside a workload container
    (150 MiB of shm, 40 MiB of heap) in a pod slice with a 256 MiB limit. Without the host's
    cgroupfs it estimates from the workload's processes: marked estimated, the working set
    within 15 % of the pod's, the OOM-risk ratio within 0.08, a projection above 1 (1 GiB of
    shm cannot fit), the flag's limit. With the host's cgroupfs read-only it reads the pod's
    cgroup: not estimated, working set within 5 %, the pod's limit, no estimate beside it."""
    out, results, log = vm_run
    image_needed(results)
    assert results.get("docker"), log
    for name, facts in results["docker"].items():
        s = scrape(out, f"docker-docker-{name}")
        pod = facts["pod"]
        pod_working_set = pod["current"] - pod["inactive_file"]
        [(labels, working_set)] = select(s, "shmwatch_cgroup_memory_working_set_bytes")
        cgroup = labels["cgroup"]
        [(limit_labels, limit)] = select(s, "shmwatch_cgroup_memory_limit_bytes")
        estimated = name == "private"
        assert value(s, "shmwatch_cgroup_memory_estimated", cgroup=cgroup) == int(estimated), (name, facts)
        assert abs(working_set - pod_working_set) <= (0.15 if estimated else 0.05) * pod_working_set, (name, facts)
        assert value(s, "shmwatch_shm_oom_projection_ratio", cgroup=cgroup, mount="/dev/shm") > 1, name
        assert value(s, "shmwatch_mount_effective_size_bytes", mount="/dev/shm") <= pod["max"], name
        assert limit == pod["max"] == 256 * MiB, (name, limit_labels)
        if estimated:
            assert cgroup == "estimate:workload" and limit_labels["limit_from"] == "flag"
            risk = value(s, "shmwatch_oom_risk_ratio", cgroup=cgroup)
            assert abs(risk - pod_working_set / pod["max"]) <= 0.08, (risk, facts)
        else:
            assert cgroup.endswith(f"kubepods-burstable-pod{UID2.replace('-', '_')}.slice"), cgroup
            assert limit_labels["limit_from"] == "pod", limit_labels
        assert facts["workload_cgroup"] == facts["sidecar_cgroup"] == "0::/", facts  # private namespaces


@needs_root
def test_a_container_oom_kill_is_counted_for_its_pod(vm_run):
    """tests/containers/test_oom.py on v2: a container with its own 64 MiB limit in a pod
    slice, OOM-killed and removed; node mode counts the kill for the pod, and PodOomKilled
    fires on the series it exported."""
    from tests.containers.test_oom import pod_oom_killed_test

    out, results, log = vm_run
    image_needed(results)
    oom = steps(results)["container_oom"]
    assert oom["oom_killed"] == "true" and not oom["container_cgroup_left"], log
    pod = POD.replace(UID.replace("-", "_"), UID3.replace("-", "_"))
    before, after = scrape(out, "before-node-oom"), scrape(out, "after-node-oom")
    assert pod.endswith(".slice")  # node mode names the pod's cgroup by its pod_uid alone
    assert value(before, "shmwatch_cgroup_oom_kills_total", pod_uid=UID3) == 0
    [(labels, kills)] = select(after, "shmwatch_cgroup_oom_kills_total", pod_uid=UID3)
    assert kills == 1 and labels == {"pod_uid": UID3}, log
    pairs = ", ".join(f'{k}="{v}"' for k, v in sorted({**labels, "instance": "node:9841", "job": "shmwatch"}.items()))
    result = pod_oom_killed_test(f"shmwatch_cgroup_oom_kills_total{{{pairs}}}", "0x2 1x4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@needs_root
def test_memory_high_panel_shows_a_throttled_pod_in_node_mode(vm_run, tmp_path):
    """Node mode's pods have no memory.high of their own (MemoryQoS sets their containers'):
    the dashboard's memory.high panel draws the pod's limit once its memory.events counts its
    container throttled, on a real Prometheus scraping the VM's node-mode exposition."""
    from tests.live import Prometheus
    from tests.system.test_dashboard import panels
    from tests.system.test_dashboard_pods import rules_file, serving, substitute

    out, results, log = vm_run
    assert "throttled" in steps(results), log
    text = (out / "throttled-node.prom").read_text()
    ksm = f'kube_pod_info{{namespace="llm",pod="vllm-0",uid="{UID}",node="vm",job="kube-state-metrics"}} 1\n'
    [panel] = [p for p in panels() if p["title"] == "memory.high and the shm under it"]
    with (
        serving(text) as node,
        serving(ksm) as kube,
        Prometheus(
            str(tmp_path),
            [node, kube],
            rules=rules_file(tmp_path / "rules.yml"),
            honor_labels=True,
        ) as prom,
    ):
        exprs = {t["legendFormat"]: substitute(t["expr"], "vllm-0") for t in panel["targets"]}
        prom.wait_query(exprs["shmem {{pod}} {{cgroup}}"], timeout=60)  # the rules' pod names joined
        prom.wait_query(exprs["limit {{pod}} {{cgroup}} (throttled under it)"], timeout=30)
        answers = {legend: prom.query(expr) for legend, expr in exprs.items()}
    # The pod's series, named by its pod_uid (node mode writes no cgroup path for a pod's).
    limit = [r for r in answers["limit {{pod}} {{cgroup}} (throttled under it)"] if r["metric"].get("pod_uid") == UID]
    assert limit and float(limit[0]["value"][1]) == 256 * MiB, answers
    assert answers["memory.high {{pod}} {{cgroup}}"] == [], answers  # the pod has none: the old panel's only line
