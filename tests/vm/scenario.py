"""Runs inside the cgroup v2 VM (tests/vm/test_cgroup_v2_vm.py): real pod slices on the systemd
driver's layout, shmwatch in host and node mode against them. It only acts and records (scrapes,
cgroup files, timings) into OUT; the assertions are made on the host side.

    python3 scenario.py OUT        (shmwatch and its dependencies on PYTHONPATH)

Stdlib only. The VM's CPU is emulated: every wait is on a condition, with generous deadlines.
"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

OUT = sys.argv[1]
MiB = 1 << 20
UID = "5e1f0c2a-7b3d-4e8f-9a6b-1c2d3e4f5a6b"
ROOT = "/sys/fs/cgroup"
QOS = "kubepods.slice/kubepods-burstable.slice"
POD = f"{QOS}/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
SCOPE = f"{POD}/cri-containerd-{'ab' * 32}.scope"
DSHM = f"/var/lib/kubelet/pods/{UID}/volumes/kubernetes.io~empty-dir/dshm"
T0 = time.monotonic()
results = {"steps": [], "errors": []}


def log(msg):
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def save():
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=1)


def cg(path, name, value=None):
    full = os.path.join(ROOT, path, name)
    if value is None:
        with open(full) as f:
            return f.read()
    with open(full, "w") as f:
        f.write(str(value))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Exporter:
    def __init__(self, name, *args):
        self.name, self.port = name, free_port()
        self.log = open(os.path.join(OUT, f"exporter-{name}.log"), "w")
        argv = [
            sys.executable,
            "-m",
            "exporter",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--no-collector.gpu",
            "--poll-interval=1s",
            "--inventory-interval=5s",
            "--metric-opt-in-list=.*",  # every family: the opt-in ones are checked too
            *args,
        ]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def scrape(self):
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return r.read().decode()

    def wait_for(self, *patterns, timeout=180.0):
        """The first scrape with a line matching each of `patterns` (regexes); the last one if none
        did. Sources run on their own schedules: a scrape that shows one may not yet show another."""
        deadline, text = time.monotonic() + timeout, ""
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"exporter {self.name} exited {self.proc.returncode}")
            try:
                text = self.scrape()
            except OSError:
                text = ""
            if all(re.search(p, text, re.M) for p in patterns):
                return text
            time.sleep(0.5)
        results["errors"].append(f"{self.name}: no lines matching {patterns!r} in {timeout}s")
        return text

    def record(self, step, text):
        with open(os.path.join(OUT, f"{step}-{self.name}.prom"), "w") as f:
            f.write(text)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def in_scope(argv, **kw):
    """A process started in the container's scope (it writes its own PID into cgroup.procs)."""
    enter = f'echo $$ > {ROOT}/{SCOPE}/cgroup.procs && exec "$@"'
    return subprocess.Popen(["sh", "-c", enter, "sh", *argv], **kw)


def step(name, **facts):
    facts["name"], facts["t"] = name, round(time.monotonic() - T0, 1)
    results["steps"].append(facts)
    log(f"step {name}: {facts}")
    save()


def main():
    results["kernel"] = os.uname().release
    results["cgroup_fs"] = subprocess.run(["stat", "-fc", "%T", ROOT], capture_output=True, text=True).stdout.strip()
    # The kubelet's systemd layout, made by hand: memory enabled down to the container's scope.
    for level in ("kubepods.slice", QOS, POD, SCOPE):
        os.makedirs(os.path.join(ROOT, level), exist_ok=True)
        if level != SCOPE:
            cg(level, "cgroup.subtree_control", "+memory")
    cg(POD, "memory.max", 256 * MiB)
    os.makedirs(DSHM, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", DSHM], check=True)
    results["dshm_options"] = [line for line in open("/proc/self/mountinfo") if DSHM in line]
    # The workload: a long-lived process in the scope (spared by the OOM killer, so the writer
    # below is the victim), and 150 MiB written into the pod's emptyDir from the scope.
    holder = os.path.join(OUT, "shmholder")
    with open(holder, "w") as f:
        f.write("#!/bin/sh\nwhile :; do sleep 3600; done\n")
    os.chmod(holder, 0o755)
    shutil.copy(holder, "/usr/local/bin/shmholder")
    workload = in_scope(["/usr/local/bin/shmholder"])
    time.sleep(0.5)
    with open(f"/proc/{workload.pid}/oom_score_adj", "w") as f:
        f.write("-1000")
    dd = in_scope(["dd", "if=/dev/zero", f"of={DSHM}/psm_kv", "bs=1M", "count=150", "status=none"])
    step(
        "filled",
        dd_rc=dd.wait(),
        scope_shmem=stat(SCOPE, "shmem"),
        pod_current=int(cg(POD, "memory.current")),
    )
    cg(SCOPE, "memory.high", 200 * MiB)

    exporters = [
        Exporter("host", f"--cgroup.path={ROOT}/{SCOPE}", f"--shm.mount={DSHM}"),
        Exporter("target", "--cgroup.target-process=^shmholder$", f"--shm.mount={DSHM}"),
        Exporter("node", "--mode=node"),
    ]
    try:
        for e in exporters:
            e.record("acceptance", e.wait_for(r"^shmwatch_shm_oom_projection_ratio\{"))
        step(
            "acceptance",
            pod_memory_max=cg(POD, "memory.max").strip(),
            scope_high=cg(SCOPE, "memory.high").strip(),
        )

        # Throttled at memory.high: 12 MiB more from the scope, 2 MiB over a memory.high of
        # 160 MiB; the pod (no memory.high of its own) counts its container's `high` events.
        cg(SCOPE, "memory.high", 160 * MiB)
        over = in_scope(
            [
                "dd",
                "if=/dev/zero",
                f"of={DSHM}/psm_high",
                "bs=1M",
                "count=12",
                "status=none",
            ]
        )
        try:
            rc = over.wait(300)
        except subprocess.TimeoutExpired:  # throttled past it: the wait below says what is missing
            over.kill()
            rc = over.wait()
        node = exporters[2]
        pattern = r'^shmwatch_cgroup_memory_events_total\{(?=.*event="high")(?=.*pod_uid="%s").*\} [1-9]' % UID
        node.record("throttled", node.wait_for(pattern))
        os.unlink(f"{DSHM}/psm_high")
        step("throttled", writer_rc=rc, pod_events=cg(POD, "memory.events"))

        # A writer past the pod's limit: OOM-killed, the pod's count rises in /metrics.
        cg(SCOPE, "memory.high", "max")  # else it is throttled at 200 MiB instead of killed
        writer = in_scope(
            [
                "dd",
                "if=/dev/zero",
                f"of={DSHM}/psm_big",
                "bs=1M",
                "count=300",
                "status=none",
            ]
        )
        rc = writer.wait(600)
        events = cg(POD, "memory.events")
        node = exporters[2]
        node.record(
            "oom",
            node.wait_for(
                r'^shmwatch_cgroup_oom_kills_total\{.*pod_uid="%s".*\} [1-9]' % UID,
                r'^shmwatch_cgroup_memory_events_total\{(?=.*event="oom_kill")(?=.*pod_uid="%s").*\} [1-9]' % UID,
            ),
        )
        exporters[0].record(
            "oom",
            exporters[0].wait_for(r'^shmwatch_cgroup_memory_events_total\{.*event="oom_kill".*\} [1-9]'),
        )
        step(
            "oom",
            writer_rc=rc,
            pod_events=events,
            holder_alive=workload.poll() is None,
            big_bytes=os.path.getsize(f"{DSHM}/psm_big"),
        )

        # memory.max lowered at run time: the effective size follows within a poll.
        os.unlink(f"{DSHM}/psm_big")
        for e in exporters:  # the freed pages seen first
            e.wait_for(r"^shmwatch_mount_used_bytes\{.*\} 1\.5728\d*e\+08")
        lowered = time.monotonic()
        cg(POD, "memory.max", 200 * MiB)
        followed = {}
        for e in exporters:
            text = e.wait_for(r"^shmwatch_cgroup_memory_limit_bytes\{.*\} 2\.097152e\+08", timeout=60)
            followed[e.name] = round(time.monotonic() - lowered, 2)
            e.record("lowered", text)
        step("lowered", seconds=followed, pod_memory_max=cg(POD, "memory.max").strip())
    finally:
        for e in exporters:
            e.stop()
        workload.kill()
        save()
    if os.environ.get("SHMWATCH_VM_DOCKER", "1") == "1":
        try:
            docker_sidecar()
        except Exception as err:
            results["errors"].append(f"docker: {type(err).__name__}: {err}")
        save()


UID2 = "6f2a1d3b-8c4e-4f9a-8b7c-2d3e4f5a6b7c"
POD2_UNIT = f"kubepods-burstable-pod{UID2.replace('-', '_')}.slice"
POD2 = f"{QOS}/{POD2_UNIT}"


def docker(*args, check=True):
    proc = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)
    if check and proc.returncode:
        raise RuntimeError(f"docker {' '.join(args[:2])}: {proc.stderr.strip()}")
    return proc.stdout.strip()


# The workload container: 150 MiB in its /dev/shm and 40 MiB of private anonymous memory (a
# server's heap), then it holds them.
WORKLOAD = """
import time
with open("/dev/shm/psm_kv", "wb") as f:
    for _ in range(150):
        f.write(b"\\1" * (1 << 20))
held = bytearray(b"\\2") * (40 << 20)
open("/tmp/filled", "w").close()
while True:
    time.sleep(3600)
"""
HOG = "hog = []\nwhile True: hog.append(bytearray(1 << 20))\n"
SIDECAR_RUN = [
    "--user",
    "0:0",
    "--cap-drop",
    "ALL",
    "--cap-add",
    "SYS_PTRACE",
    "--read-only",
]


def docker_sidecar():
    """The project's image (built from the Dockerfile on the host, `docker load`ed here) as a
    sidecar container, Docker's defaults on v2 (a private cgroup namespace), beside a workload
    container in a pod slice with a 256 MiB limit: without the host's cgroupfs (an estimate from
    the workload's processes), and with it mounted read-only. Then a container with its own
    64 MiB limit in a pod slice, OOM-killed and removed: node mode counts the kill for the pod."""
    with open("/io/extra/image.json") as f:
        image = json.load(f)
    results["image"] = image
    if "tag" not in image:  # no container engine on the host: the host side says so
        return
    t = time.monotonic()
    # The host loaded the image's base into a docker data-root on this disk; the archive
    # loaded here has the project's own layers only.
    os.makedirs("/var/lib/docker", exist_ok=True)
    subprocess.run(["mount", "/dev/vdb", "/var/lib/docker"], check=True, timeout=120)
    subprocess.run(["systemctl", "start", "docker"], check=True, timeout=300)
    timings = {"docker_start_s": round(time.monotonic() - t, 1)}
    t = time.monotonic()
    docker("load", "-q", "-i", "/io/extra/shmwatch-image.tar")
    timings["load_s"] = round(time.monotonic() - t, 1)
    results["image_loaded_id"] = docker("image", "inspect", "-f", "{{.Id}}", image["tag"])
    tag = image["tag"]
    t = time.monotonic()
    docker(
        "run",
        "-d",
        "--name",
        "workload",
        f"--cgroup-parent={POD2_UNIT}",
        "--shm-size=1g",
        "--ipc=shareable",
        "--entrypoint",
        "python3",
        tag,
        "-c",
        WORKLOAD,
    )
    cg(POD2, "memory.max", 256 * MiB)
    deadline = time.monotonic() + 180
    while docker("exec", "workload", "sh", "-c", "test -e /tmp/filled && echo y", check=False) != "y":
        if time.monotonic() > deadline:
            raise RuntimeError("the workload container did not fill its /dev/shm: " + docker("logs", "workload"))
        time.sleep(1)
    timings["workload_s"] = round(time.monotonic() - t, 1)
    # The sidecars outside the pod's slice, so the pod's cgroup is the workload's alone and
    # comparable with what each sidecar reports; the Downward API's limit as the flag.
    common = [
        "run",
        "-d",
        "--pid=container:workload",
        "--ipc=container:workload",
        "--network=host",
        *SIDECAR_RUN,
    ]
    args = [
        "--no-collector.gpu",
        "--poll-interval=1s",
        "--inventory-interval=5s",
        "--shm.mount=/dev/shm",
        f"--memory.limit-bytes={256 * MiB}",
        "--metric-opt-in-list=.*",  # the estimate's flag and ratio are opt-in families
    ]
    sidecars = {
        "private": (free_port(), []),
        "private-hostfs": (
            free_port(),
            ["-v", "/sys/fs/cgroup:/host/sys/fs/cgroup:ro"],
        ),
    }
    t = time.monotonic()
    for name, (port, extra) in sidecars.items():
        docker(
            *common,
            "--name",
            f"side-{name}",
            *extra,
            tag,
            *args,
            f"--web.listen-address=127.0.0.1:{port}",
        )
    facts = {}
    for name, (port, _) in sidecars.items():
        e = Exporter.__new__(Exporter)
        e.name, e.port, e.proc = f"docker-{name}", port, None
        # The process side (the estimate) runs on the inventory's schedule, after the mount's.
        text = e.wait_for(
            r"^shmwatch_cgroup_memory_working_set_bytes\{",
            r"^shmwatch_shm_oom_projection_ratio\{",
            r"^shmwatch_mount_used_bytes\{.*\} 1\.5728\d*e\+08",
        )
        pod = {
            "current": int(cg(POD2, "memory.current")),
            "max": int(cg(POD2, "memory.max")),
            "inactive_file": stat(POD2, "inactive_file"),
            "shmem": stat(POD2, "shmem"),
            "anon": stat(POD2, "anon"),
        }
        e.record("docker", text)
        facts[name] = {
            "pod": pod,
            "log": docker("logs", f"side-{name}", check=False)[-3000:],
            "workload_cgroup": docker("exec", "workload", "cat", "/proc/self/cgroup", check=False),
            "sidecar_cgroup": docker("exec", f"side-{name}", "cat", "/proc/self/cgroup", check=False),
        }
    timings["sidecars_s"] = round(time.monotonic() - t, 1)
    results["docker"] = facts
    step("docker", **timings)
    docker("rm", "-f", "side-private", "side-private-hostfs", "workload", check=False)
    container_oom(tag)


UID3 = "7a3b2e4c-9d5f-4a0b-9c7d-3e4f5a6b7c8d"
POD3_UNIT = f"kubepods-burstable-pod{UID3.replace('-', '_')}.slice"
POD3 = f"{QOS}/{POD3_UNIT}"


def container_oom(tag):
    """tests/containers/test_oom.py on v2: a container with its own limit (--memory=64m) in a
    pod slice, OOM-killed and removed; node mode counts the kill for the pod (the pod's
    memory.events counts its children's kills and outlives them)."""
    os.makedirs(os.path.join(ROOT, POD3), exist_ok=True)  # the kubelet makes the pod's cgroup first
    node = Exporter("node-oom", "--mode=node", "--no-collector.segments")
    try:
        node.record(
            "before",
            node.wait_for(r'^shmwatch_cgroup_oom_kills_total\{.*pod_uid="%s".*\} 0' % UID3),
        )
        t = time.monotonic()
        cid = docker(
            "run",
            "-d",
            "--name",
            "hog",
            f"--cgroup-parent={POD3_UNIT}",
            "--memory=64m",
            "--memory-swap=64m",
            "--entrypoint",
            "python3",
            tag,
            "-c",
            HOG,
        )
        deadline = time.monotonic() + 300
        while docker("inspect", "-f", "{{.State.Running}}", "hog") == "true" and time.monotonic() < deadline:
            time.sleep(0.5)
        oom_killed = docker("inspect", "-f", "{{.State.OOMKilled}}", "hog")
        container = f"{POD3}/docker-{cid}.scope"
        docker("rm", "-f", "hog")
        node.record(
            "after",
            node.wait_for(r'^shmwatch_cgroup_oom_kills_total\{.*pod_uid="%s".*\} 1' % UID3),
        )
        gone = time.monotonic() + 15  # systemd removes the scope after the container's exit
        while os.path.exists(os.path.join(ROOT, container)) and time.monotonic() < gone:
            time.sleep(0.5)
        step(
            "container_oom",
            oom_killed=oom_killed,
            seconds=round(time.monotonic() - t, 1),
            container_cgroup_left=os.path.exists(os.path.join(ROOT, container)),
            pod_events=cg(POD3, "memory.events"),
        )
    finally:
        node.stop()


def stat(path, key):
    for line in cg(path, "memory.stat").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return None


if __name__ == "__main__":
    try:
        main()
    except Exception as err:  # recorded for the host side, which fails with it
        results["errors"].append(f"{type(err).__name__}: {err}")
        save()
        raise
