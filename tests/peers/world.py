"""One pod-shaped world for one test cell, run as pid 1 of PID, mount and IPC namespaces of
its own (`tests.helpers.run_world` starts it): a fresh tmpfs at /dev/shm, a fresh procfs at
/proc mounted with the cell's hidepid, real processes under real UIDs that hold segments or
left them behind (tests/peers/shm_peer.py), SysV segments whose creators live or exited, and
shmwatch itself as root or another UID, in this PID namespace or in one of its own.

Pid 1 (this script) names itself 'pause', as a Kubernetes pod's first process: root's, and
not readable by another UID. Nothing outlives it: when pid 1 exits the kernel kills every
process of the namespace, and the mounts and SysV segments go with their namespaces.

Its one argument is the cell as JSON:
  hidepid   the procfs option: 0 (off), 1 (noaccess), 2 (invisible), 4 (ptraceable)
  holders   [{mode, name, size, uid, comm?, undumpable?, pidns?}]: shm_peer.py holding a
            segment until the end (pidns: in a PID namespace of its own, below this one)
  left      [{name, size, uid, pidns?, age?}]: shm_peer.py `left`: a file whose creator
            exited (name: in /dev/shm, or an absolute path; age: its mtime that long ago)
  mounts    {path under /mnt: size}: more tmpfs mounts (shmwatch watches what `args` say)
  sysv      [{uid, alive, pidns?}]: a SysV segment, never attached, whose creator lives or
            exited (in this world's IPC namespace, which shmwatch shares unless `ipcns`)
  exporters {label: {uid, python, ignore, pidns?, ipcns?, sidecar?, args?, serve?, text?}}:
            each a way shmwatch runs in this world, one after the other (python: the
            interpreter for a non-root UID; ignore: --segments.ignore-unreadable; sidecar:
            check run in the PID namespace of a serving shmwatch, as `kubectl exec` into a
            sidecar; serve: also scrape /metrics once every collector has run; text: also
            check's text output)
It prints one JSON line: per exporter, check's document, exit code and stderr (and /metrics,
text); the SysV ids, and their creators' pids as pid 1 sees them."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional, Tuple

Spec = Dict[str, Any]  # a part of the cell, as JSON gives it

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PEER = os.path.join(REPO, "tests", "peers", "shm_peer.py")
# Debian's, readable by every UID (the test's may not be)
PEER_PYTHON = "/usr/bin/python3"
SYSV_CREATOR = r"""
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0, 65536, 0o1600)  # IPC_PRIVATE, IPC_CREAT | 0600; never attached
assert shmid >= 0, ctypes.get_errno()
print(shmid, flush=True)
if sys.argv[1] == "alive":
    sys.stdin.read()
"""


def as_uid(uid: int) -> List[str]:
    """A command prefix that runs as `uid` with no capabilities (as a container's user)."""
    if uid == 0:
        return []
    return [
        "setpriv",
        f"--reuid={uid}",
        f"--regid={uid}",
        "--clear-groups",
        "--inh-caps=-all",
        "--bounding-set=-all",
    ]


def in_pid_namespace(yes: bool) -> List[str]:
    return ["unshare", "--pid", "--fork", "--mount-proc"] if yes else []


def start(
    argv: List[str], env: Optional[Dict[str, str]] = None
) -> Tuple["subprocess.Popen[str]", str]:
    """(the process, the first line it printed: it is ready)."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None and proc.stderr is not None
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"{argv} failed: {proc.stderr.read()[-2000:]}")
    return proc, line.strip()


def hold(holder: Spec) -> "subprocess.Popen[str]":
    argv = [
        *in_pid_namespace(holder.get("pidns", False)),
        *as_uid(holder["uid"]),
        PEER_PYTHON,
        PEER,
        holder["mode"],
        holder["name"],
        str(holder["size"]),
    ]
    env = {"SHM_PEER_COMM": holder.get("comm", "")}
    env["SHM_PEER_UNDUMPABLE"] = "1" if holder.get("undumpable") else ""
    return start(argv, env)[0]


def leave(left: Spec) -> None:
    argv = [
        *in_pid_namespace(left.get("pidns", False)),
        *as_uid(left["uid"]),
        PEER_PYTHON,
        PEER,
        "left",
        left["name"],
        str(left["size"]),
    ]
    start(argv)[0].wait(10)
    if age := left.get("age"):
        path = os.path.join("/dev/shm", left["name"])
        then = time.time() - age
        os.utime(path, (then, then))


def make_sysv(creator: Spec) -> Tuple["subprocess.Popen[str]", int]:
    """(the creator, which has exited unless `alive`; the segment's shmid)."""
    state = "alive" if creator["alive"] else "gone"
    prefix = in_pid_namespace(creator.get("pidns", False)) + as_uid(creator["uid"])
    proc, shmid = start([*prefix, PEER_PYTHON, "-c", SYSV_CREATOR, state])
    if not creator["alive"]:
        proc.wait(10)
    return proc, int(shmid)


def exporter_argv(exporter: Spec, *args: str) -> List[str]:
    prefix = ["unshare", "--ipc"] if exporter.get("ipcns") else []
    prefix += in_pid_namespace(exporter.get("pidns", False))
    if pid := exporter.get("enter"):  # as `kubectl exec` enters a running container
        prefix += ["nsenter", f"--target={pid}", "--pid", "--mount"]
    prefix += as_uid(exporter["uid"])
    python = str(exporter["python"]) if exporter["uid"] else sys.executable
    return [
        *prefix,
        python,
        "-m",
        "exporter",
        *args,
        "--shm.mount=/dev/shm",
        "--no-collector.gpu",
        "--no-collector.cgroup",
        "--no-collector.host_memory",  # the host's, outside this world: not what is tested
        *exporter.get("args", []),
    ]


def exporter_env(exporter: Spec) -> Dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": REPO,
        "SHMWATCH_SEGMENTS_IGNORE_UNREADABLE": exporter.get("ignore", ""),
    }


def check(exporter: Spec, output: str = "json") -> "subprocess.CompletedProcess[str]":
    return subprocess.run(
        exporter_argv(exporter, "check", f"--output={output}"),
        cwd=REPO,
        env=exporter_env(exporter),
        capture_output=True,
        text=True,
        timeout=60,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def every_collector_ran(text: str) -> bool:
    durations = [
        line.rsplit(" ", 1)[1]
        for line in text.splitlines()
        if line.startswith("shmwatch_collector_duration_seconds{")
    ]
    return bool(durations) and all(float(d) > 0 for d in durations)


def scrape(exporter: Spec) -> str:
    port = free_port()
    server = serving(exporter, port)
    deadline = time.monotonic() + 30
    try:
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(
                    f"http://127.0.0.1:{port}/metrics", timeout=5
                ) as response:
                    text: str = response.read().decode()
                if every_collector_ran(text):
                    return text
            except OSError:
                pass
            time.sleep(0.05)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        _, err = server.communicate(timeout=10)
    raise RuntimeError(
        f"shmwatch never answered with every collector run: {err[-2000:]}"
    )


def shm_segments() -> Dict[int, int]:
    """shmid -> cpid, as this namespace's pid 1 reads /proc/sysvipc/shm."""
    with open("/proc/sysvipc/shm") as f:
        header, *rows = f.read().splitlines()
    col = header.split().index
    return {int(r.split()[col("shmid")]): int(r.split()[col("cpid")]) for r in rows}


def serving(exporter: Spec, port: int) -> "subprocess.Popen[str]":
    """`shmwatch` serving, in a process group of its own: stopped with killpg, as `unshare
    --fork` does not pass SIGTERM on to a shmwatch below it."""
    argv = exporter_argv(exporter, f"--web.listen-address=127.0.0.1:{port}")
    return subprocess.Popen(
        argv + ["--no-inotify"],
        cwd=REPO,
        env=exporter_env(exporter),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def pid_one_below(unshare: int) -> int:
    """The pid (in ours) of the shmwatch `unshare --fork` started as pid 1 of its namespace,
    once it runs (its /proc mounted)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{unshare}/task/{unshare}/children") as f:
            children = f.read().split()
        if children:
            with open(f"/proc/{children[0]}/cmdline", "rb") as f:
                if b"exporter" in f.read():
                    return int(children[0])
        time.sleep(0.01)
    raise RuntimeError("unshare started no shmwatch")


def run(exporter: Spec) -> Spec:
    """check (and scrape) as `exporter` says. `sidecar`: shmwatch serves as pid 1 of a PID
    namespace of its own, and check runs in it (`kubectl exec` into a sidecar), beside a
    zombie an earlier exec left."""
    if not exporter.get("sidecar"):
        return run_once(exporter)
    sidecar = serving({**exporter, "pidns": True}, free_port())
    try:
        pid = pid_one_below(sidecar.pid)
        # An earlier exec's child left there: a zombie of pid 1, which never reaps it.
        enter = ["nsenter", f"--target={pid}", "--pid", "--mount"]
        subprocess.run([*enter, "sh", "-c", "sleep 0.1 & exit 0"], check=True)
        time.sleep(0.3)
        return run_once({**exporter, "enter": pid})
    finally:
        os.killpg(sidecar.pid, signal.SIGTERM)
        sidecar.communicate(timeout=10)


def run_once(exporter: Spec) -> Spec:
    done = check(exporter)
    out = {"rc": done.returncode, "stderr": done.stderr[-3000:]}
    out["check"] = (
        json.loads(done.stdout) if done.stdout.startswith("{") else done.stdout
    )
    if exporter.get("text"):
        out["text"] = check(exporter, "text").stdout
    if exporter.get("serve"):
        out["metrics"] = scrape(exporter)
    return out


def mount_tmpfs(path: str, size: str) -> None:
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=1777", "tmpfs", path],
        check=True,
    )


def main(cell: Spec) -> None:
    with open("/proc/self/comm", "w") as f:
        f.write("pause")
    mount_tmpfs("/dev/shm", "1g")
    if mounts := cell.get("mounts"):
        mount_tmpfs(
            "/mnt", "1m"
        )  # in this mount namespace only: nothing made on the host's /mnt
        for path, size in mounts.items():
            assert os.path.dirname(path) == "/mnt", path
            os.mkdir(path)
            mount_tmpfs(path, size)
    subprocess.run(
        ["mount", "-t", "proc", "-o", f"hidepid={cell['hidepid']}", "proc", "/proc"],
        check=True,
    )
    holders = [hold(h) for h in cell.get("holders", [])]
    for left in cell.get("left", []):
        leave(left)
    creators = [make_sysv(creator) for creator in cell.get("sysv", [])]
    out: Spec = {
        "holders": [p.pid for p in holders],
        "shmids": [shmid for _, shmid in creators],
    }
    out["runs"] = {
        label: run(exporter) for label, exporter in cell["exporters"].items()
    }
    out["sysv_cpid"] = shm_segments()
    for proc in holders + [p for p, _ in creators]:
        proc.communicate(timeout=10)  # stdin closed: each lets go and exits
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
