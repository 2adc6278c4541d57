"""Run sources once against a tree and read the values back from a fresh registry."""
import os
from dataclasses import dataclass
from typing import Dict, Iterable, Optional

from prometheus_client.registry import CollectorRegistry

from exporter.collectors.discovery import MountDiscovery
from exporter.exposition.metrics import ModelCollector
from exporter.model.step import ModelStep
from exporter.host.paths import Paths
from exporter.runtime.scheduler import Sampler
from exporter.model.state import StateStore


@dataclass
class Harness:
    sampler: Sampler
    state: StateStore
    step: ModelStep


def run_every_source_once(sampler):
    """Each source's full run, in this thread, published as the scheduler would."""
    for runner in sampler.runners.values():
        runner.run_once(full=True)


def registry_for(*sources, shm_size_limit=None, memory_limit=None, mounts=None):
    """The serve path without threads: sampler -> model step -> ModelCollector. The mounts
    are the first source's that has any (or `mounts`)."""
    if mounts is None:
        mounts = next((s.mounts() for s in sources if s.name in ("shm_mount", "segments")), [])
    discovery = MountDiscovery(Paths(), mounts)
    state = StateStore()
    sampler = Sampler(list(sources))
    step = ModelStep(sources, discovery, state, shm_size_limit=shm_size_limit, memory_limit=memory_limit)
    sampler.subscribe(step.accept)
    run_every_source_once(sampler)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelCollector(step))
    return registry, Harness(sampler, state, step)


# --- a /proc tree in a directory (the unit tests' injected --path.procfs) -------------------
# A file that even root may not read (sysctl files keep their mode for root): a /proc entry
# linked to it answers EACCES, as another user's maps do without CAP_SYS_PTRACE.
DENIED_FILE = "/proc/sys/vm/drop_caches"
INITIAL_PID_NS = f"pid:[{0xEFFFFFFC}]"


def mountinfo_line(mount_id: int, device: str, point: str, fstype: str = "tmpfs", options: str = "rw") -> str:
    """One /proc/<pid>/mountinfo line (`point` without spaces)."""
    return f"{mount_id} 1 {device} / {point} rw,relatime - {fstype} {fstype} {options}\n"


def devno(dev: int) -> str:
    """st_dev -> 'major:minor', as mountinfo prints it."""
    return f"{os.major(dev)}:{os.minor(dev)}"


class FakeProc:
    """A procfs tree under `root`, written as the kernel shows it, for Paths(procfs=root): each
    process its stat, comm, maps, mountinfo, cgroup, fds and fdinfo; the kernel's pid counters.
    Directories are owned by the test's UID unless `uid` asks another (root only)."""

    def __init__(self, root: str, last_pid: int = 300, pid_max: int = 4194304, forks: int = 1000):
        self.root = root
        os.makedirs(os.path.join(root, "sys", "kernel"), exist_ok=True)
        self.counters(last_pid, pid_max, forks)

    @property
    def paths(self) -> Paths:
        return Paths(procfs=self.root)

    def path(self, *parts: object) -> str:
        return os.path.join(self.root, *map(str, parts))

    def write(self, relative: str, text: str) -> str:
        path = os.path.join(self.root, relative)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        return path

    def counters(self, last_pid: int, pid_max: int, forks: int) -> None:
        """ns_last_pid, pid_max and the fork count (/proc/stat's "processes")."""
        self.write("sys/kernel/ns_last_pid", f"{last_pid}\n")
        self.write("sys/kernel/pid_max", f"{pid_max}\n")
        self.write("stat", f"cpu  1 2 3 4\nprocesses {forks}\nprocs_running 1\n")

    def add(self, pid: int, comm: str = "python3", *, uid: Optional[int] = None, ppid: int = 1, start: int = 0,
            flags: int = 0, maps: str = "", mountinfo: Optional[str] = "", cgroup: str = "",
            fds: Optional[Dict[int, str]] = None, mnt_ids: Optional[Dict[int, int]] = None,
            mnt_ns: Optional[str] = None) -> None:
        """A process. `fds`: fd -> where its link points; `mnt_ids`: fd -> fdinfo's mnt_id;
        `mountinfo` None: none (a fixture without one); `mnt_ns`: its ns/mnt link."""
        d = str(pid)
        self.write(f"{d}/stat", f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 {flags} 0 0 0 0 0 0 0 0 20 0 1 0"
                                f" {start or pid} 0 0\n")
        self.write(f"{d}/comm", comm + "\n")
        self.write(f"{d}/maps", maps)
        self.write(f"{d}/cgroup", cgroup)
        if mountinfo is not None:
            self.write(f"{d}/mountinfo", mountinfo)
        os.makedirs(self.path(d, "fd"), exist_ok=True)
        os.makedirs(self.path(d, "fdinfo"), exist_ok=True)
        for fd, target in (fds or {}).items():
            os.symlink(target, self.path(d, "fd", fd))
            mnt = (mnt_ids or {}).get(fd)
            info = "pos:\t0\nflags:\t02\n" + ("" if mnt is None else f"mnt_id:\t{mnt}\n")
            self.write(f"{d}/fdinfo/{fd}", info)
        if mnt_ns is not None:
            os.makedirs(self.path(d, "ns"), exist_ok=True)
            os.symlink(mnt_ns, self.path(d, "ns", "mnt"))
        if uid is not None:
            os.chown(self.path(d), uid, -1)

    def deny(self, pid: int, name: str) -> None:
        """/proc/<pid>/<name> answers EACCES (another UID's maps, without ptrace access)."""
        path = self.path(pid, name)
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(DENIED_FILE, path)

    def map_file(self, pid: int, span: str, target: str) -> None:
        """/proc/<pid>/map_files/<span> -> target (stat'ed through, as CAP_SYS_ADMIN may)."""
        os.makedirs(self.path(pid, "map_files"), exist_ok=True)
        os.symlink(target, self.path(pid, "map_files", span))

    def self_links(self, pid: Optional[int] = None, pid_ns: Optional[str] = None) -> None:
        """/proc/self -> `pid`; /proc/self/ns/pid -> `pid_ns` (INITIAL_PID_NS: the host's)."""
        if pid is not None:
            os.symlink(str(pid), self.path("self"))
        if pid_ns is not None:
            os.makedirs(self.path("self", "ns"), exist_ok=True)
            os.symlink(pid_ns, self.path("self", "ns", "pid"))

    def self_mountinfo(self, lines: Iterable[str] = (), hidepid: Optional[str] = None) -> None:
        """Our own mountinfo: `lines`, and this procfs mounted with hidepid= when given."""
        text = "".join(lines)
        if hidepid is not None:
            proc = os.path.realpath(self.root)
            text += f"99 1 0:21 / {proc} rw,nosuid - proc proc rw,hidepid={hidepid}\n"
        self.write("self/mountinfo", text)


def maps_line(start: int, end: int, dev: int, inode: int, path: str, offset: int = 0) -> str:
    """One /proc/<pid>/maps line mapping `path` (device `dev`, as st_dev) at [start, end)."""
    return f"{start:08x}-{end:08x} rw-s {offset:08x} {os.major(dev):02x}:{os.minor(dev):02x} {inode} {path}\n"
