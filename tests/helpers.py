"""Run sources once against a tree and read the values back from a fresh registry; run a
world of real processes in namespaces of its own (tests/peers/world.py); find private
attributes of other packages a module uses; drive a real shmwatch process through a leak
storm and read its memory; a /proc tree in a directory for unit tests (FakeProc)."""
import ast
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Set, Tuple

from hypothesis import strategies as st
from prometheus_client.registry import CollectorRegistry

from exporter.collectors.discovery import MountDiscovery
from exporter.collectors.segments import FullRun, SegmentsCollector
from exporter.collectors.source import RunInput
from exporter.exposition.metrics import ModelCollector
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.inventory.changes import ChangeLog
from exporter.inventory.walk import MAX_ENTRIES
from exporter.model.state import StateStore
from exporter.model.step import ModelStep, MountView
from exporter.model.summary import shm_budget
from exporter.model.types import CgroupMemory, Inventory, MountInventory, MountUsage, Row, Segment
from exporter.runtime.scheduler import Sampler
from tests.conftest import FIXTURES, HOST_EXCUSED_RE, REPO, Exporter, Samples, select


@dataclass
class Harness:
    sampler: Sampler
    state: StateStore
    step: ModelStep


class Runs:
    """A source's runs as the scheduler makes them, on the test's thread: each handed the
    mounts (a list, or a callable read at each run) and the names inotify saw change
    (`changed`, what the watcher tells the scheduler), which full and quick runs take and a
    staged run's stages only look at (the quick runs beside its scan take them)."""

    def __init__(self, source, mounts, all_watched=False, kill_log_complete=False):
        self.source, self.mounts = source, mounts
        self.all_watched, self.kill_log_complete = all_watched, kill_log_complete
        self.log = ChangeLog()

    def changed(self, mount: str, name: Optional[str] = None) -> None:
        """`name` changed in `mount` (None: something below its top directory)."""
        if name is None:
            self.log.unknown(mount)
        else:
            self.log.add(mount, name)

    def input(self, take: bool = True) -> RunInput:
        mounts = self.mounts() if callable(self.mounts) else self.mounts
        changes = self.log.drain() if take else self.log.peek()
        return RunInput(mounts=tuple(mounts), changes=changes, all_watched=self.all_watched,
                        kill_log_complete=self.kill_log_complete)

    def full(self):
        return self.source.collect(self.input())

    def quick(self):
        return self.source.collect_quick(self.input())

    def begin(self):
        """A staged full run's first stage (the listing); then `.scan()` and `finish`."""
        return self.source.begin_full(self.input(take=False))

    def finish(self, staged):
        return staged.finish(self.input(take=False))

    def staged(self):
        """A staged full run's three stages, one after the other."""
        staged = self.begin()
        staged.scan()
        return self.finish(staged)


class SegmentRuns:
    """The segments collector's runs as the scheduler makes them (tests/unit/collectors):
    each handed `mounts()`, the names `changes` holds (a full or quick run takes them, a
    staged run's stages only look) and whether inotify watches every mount. Any other
    attribute is the collector's."""

    def __init__(
        self,
        source: SegmentsCollector,
        mounts: Callable[[], Sequence[str]],
        changes: ChangeLog,
        all_watched: Callable[[], bool] = lambda: False,
    ) -> None:
        self.source, self.mounts = source, mounts
        self.changes, self.all_watched = changes, all_watched

    def input(self, take: bool = True) -> RunInput:
        changes = self.changes.drain() if take else self.changes.peek()
        return RunInput(mounts=tuple(self.mounts()), changes=changes, all_watched=self.all_watched())

    def collect(self) -> Inventory:
        """A full run. Node mode: its stages on one thread, the names changed taken as it
        begins. A sidecar's as the scheduler runs it (runtime/scheduler.py's `_full_run`):
        the names taken as it begins, and those named while the scan read /proc handed to
        its last stage."""
        if self.source.scans_beside_quick_runs:
            return self.source.collect(self.input())
        staged = self.source.begin_full(self.input())
        staged.scan()
        return staged.finish(self.input(take=False))

    def collect_quick(self) -> Inventory:
        return self.source.collect_quick(self.input())

    def begin_full(self) -> FullRun:
        """A staged full run's first stage (the listing); then `.scan()` and `finish`."""
        return self.source.begin_full(self.input(take=False))

    def finish(self, staged: FullRun) -> Inventory:
        return staged.finish(self.input(take=False))

    @property
    def stretches(self) -> bool:
        """Asked after a full run, as the scheduler does."""
        return self.source.stretches(self.input(take=False))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def run_every_source_once(sampler: Sampler) -> None:
    """Each source's full run, in this thread, published as the scheduler would."""
    for runner in sampler.runners.values():
        runner.run_once(full=True)


def registry_for(*sources, shm_size_limit=None, memory_limit=None, mounts=()):
    """The serve path without threads: discovery's `mounts` -> sampler -> model step ->
    ModelCollector (each source's run is handed the mounts)."""
    discovery = MountDiscovery(Paths(), list(mounts))
    state = StateStore()
    sampler = Sampler([discovery, *sources], mounts=mounts)
    statuses = [s.name for s in sources if s.reports_status]
    step = ModelStep(statuses, state, shm_size_limit=shm_size_limit, memory_limit=memory_limit)
    sampler.subscribe(step.accept)
    run_every_source_once(sampler)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelCollector(step))
    return registry, Harness(sampler, state, step)


WORLD = os.path.join(REPO, "tests", "peers", "world.py")


def run_world(cell: Dict[str, Any], timeout: float = 120) -> Dict[str, Any]:
    """tests/peers/world.py for `cell`, as pid 1 of PID, mount and IPC namespaces of its own
    (nothing it mounts or starts outlives it): its report."""
    argv = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--ipc"]
    done = subprocess.run([*argv, sys.executable, WORLD, json.dumps(cell)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def mount_facts(doc: Dict[str, Any], mount: str = "/dev/shm") -> Dict[str, Any]:
    """`shmwatch check --output=json`'s facts of one mount."""
    [facts] = [m for m in doc["shm"] if m["mount"] == mount]
    return facts


def removal_advised(doc: Dict[str, Any]) -> Set[str]:
    """The paths `shmwatch check` advises to `rm`."""
    return {path for f in doc["findings"] if " rm " in f" {f['remedy']}"
            for path in f["remedy"].split(" rm ", 1)[1].split() if path.startswith("/")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree: ast.AST) -> Set[str]:
    """Private names a module makes itself: functions, classes, names it assigns, and
    attributes it assigns on its own objects (`self._x = ...`, `cls._x = ...`)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and getattr(node.value, "id", None) in ("self", "cls")):
            names.add(node.attr)
    return {name for name in names if _private(name)}


ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr", "delattr")


def _private_uses(tree: ast.AST) -> Iterator[Tuple[int, Optional[str], str]]:
    """(line, the private attribute or None for an import, what) for each private name a
    module reaches: `x._y`, getattr(x, "_y") and its kin, imports of a private name or module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.attr, f"{ast.unparse(node)}"
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_BUILTINS:
            named = node.args[1] if len(node.args) > 1 else None
            if isinstance(named, ast.Constant) and isinstance(named.value, str) and _private(named.value):
                yield node.lineno, named.value, ast.unparse(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, None, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [alias.name for alias in node.names]
            if any(_private(part) for part in (node.module or "").split(".") + names):
                yield node.lineno, None, f"from {node.module} import {', '.join(names)}"


def private_attributes_of_other_packages(path: str) -> List[str]:
    """`path:line: code` for each private name (`_x`, not a dunder) the module at `path`
    reaches but does not define itself: another package's internals (asyncio's
    `_ssl_protocol`), by attribute, by getattr/hasattr/setattr/delattr with a constant, or
    by import. The check is by name: a private the module defines passes wherever used."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    own = _defined_privates(tree)
    return [f"{path}:{line}: {code}" for line, name, code in _private_uses(tree) if name is None or name not in own]


@dataclass(frozen=True)
class StormRss:
    """A shmwatch process's resident memory (MiB) through a leak storm in one mount."""

    files: int
    before: float  # before the files were made
    full: float  # once the exporter counted them (or as many as one walk reaches)
    peak: float  # the highest since the process started (VmHWM)
    after: float  # `settle` seconds after the exporter saw the last one gone
    # (seconds after the exporter saw them gone, RSS) each second of the settle
    trace: Tuple[Tuple[float, float], ...] = ()


def status_mib(pid: int, key: str) -> float:
    """A process's VmRSS or VmHWM, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def segments_counted(samples: Samples, mount: str) -> float:
    return sum(v for _, v in select(samples, "shmwatch_segments", mount=mount))


def make_files(shm: str, names: Sequence[str]) -> None:
    for name in names:
        os.close(os.open(os.path.join(shm, name), os.O_CREAT | os.O_WRONLY, 0o600))


def leak_storm(exporter: Exporter, shm: str, files: int, settle: float = 60.0,
               back: Optional[float] = None) -> StormRss:
    """`files` empty files made in `shm` (scraped every 10,000, as Prometheus would scrape
    meanwhile), counted, deleted; then `settle` seconds of scrapes once every second, or
    fewer once RSS is `back` MiB or less above where it was before."""
    pid, names = exporter.proc.pid, [f"psm_{i:08x}" for i in range(files)]
    reached = min(files, MAX_ENTRIES)  # a walk stops there: counted as far as it reached
    for _ in range(3):  # the renders' caches as a steady exporter's
        exporter.scrape()
        time.sleep(0.3)
    before = status_mib(pid, "VmRSS")
    for start in range(0, files, 10_000):
        make_files(shm, names[start : start + 10_000])
        exporter.scrape()
    exporter.wait_for(lambda s: segments_counted(s, shm) >= reached, timeout=240, interval=0.5)
    full = status_mib(pid, "VmRSS")
    for name in names:
        os.unlink(os.path.join(shm, name))
    exporter.wait_for(lambda s: segments_counted(s, shm) == 0, timeout=240, interval=0.5)
    gone, trace = time.monotonic(), []
    while (since := time.monotonic() - gone) < settle:
        exporter.scrape()
        trace.append((round(since, 1), status_mib(pid, "VmRSS")))
        if back is not None and trace[-1][1] - before <= back:
            break
        time.sleep(min(1.0, max(0.0, settle - since)))
    after = status_mib(pid, "VmRSS")
    peak = status_mib(pid, "VmHWM")
    return StormRss(files, before, full, peak, after, tuple(trace))


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

    def __init__(self, root: str, last_pid: int = 300, pid_max: int = 4194304, forks: int = 1000,
                 hidepid: Optional[str] = "0"):
        """`hidepid`: the mount option our mountinfo gives this procfs ("0": a procfs that hides
        nothing, as most are); None: no mountinfo, so how it hides pids is unknown."""
        self.root = root
        os.makedirs(os.path.join(root, "sys", "kernel"), exist_ok=True)
        self.counters(last_pid, pid_max, forks)
        if hidepid is not None:
            self.self_mountinfo(hidepid=hidepid)

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
            # Our mountinfo goes with self (__init__ wrote it to a directory): `pid`'s now.
            kept = self._unlink_self_directory()
            os.symlink(str(pid), self.path("self"))
            if kept:
                with open(self.path(pid, "mountinfo"), "a") as f:
                    f.write(kept)
        if pid_ns is not None:
            os.makedirs(self.path("self", "ns"), exist_ok=True)
            os.symlink(pid_ns, self.path("self", "ns", "pid"))

    def _unlink_self_directory(self) -> str:
        """Removes self when it is a directory (not a link to a pid): its mountinfo's text."""
        where = self.path("self")
        if os.path.islink(where) or not os.path.isdir(where):
            return ""
        kept = ""
        if os.path.exists(os.path.join(where, "mountinfo")):
            with open(os.path.join(where, "mountinfo")) as f:
                kept = f.read()
        shutil.rmtree(where)
        return kept

    def self_mountinfo(self, lines: Iterable[str] = (), hidepid: Optional[str] = "0") -> None:
        """Our own mountinfo: `lines`, and this procfs mounted with `hidepid`= (None: this
        procfs's mount not listed, so how it hides pids is unknown)."""
        text = "".join(lines)
        if hidepid is not None:
            proc = os.path.realpath(self.root)
            text += f"99 1 0:21 / {proc} rw,nosuid - proc proc rw,hidepid={hidepid}\n"
        self.write("self/mountinfo", text)


def maps_line(start: int, end: int, dev: int, inode: int, path: str, offset: int = 0) -> str:
    """One /proc/<pid>/maps line mapping `path` (device `dev`, as st_dev) at [start, end)."""
    return f"{start:08x}-{end:08x} rw-s {offset:08x} {os.major(dev):02x}:{os.minor(dev):02x} {inode} {path}\n"


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# --- the segment summary --------------------------------------------------------------------
def seg(name, cls, state, size=MiB, mtime=0.0, holders=()):
    return Segment(name, cls, state, size, size + 1, mtime, holders)


def inventory(mount, segments, **fields):
    """A MountInventory holding `segments`, packed as the collector keeps them."""
    from exporter.model.types import CLASS_NAMES, STATES
    listed, states, hidden, held = {}, bytearray(), [], {}
    for ino, s in enumerate(segments, 1):
        if s.state == "hidden":
            hidden.append(s)
            continue
        listed[s.name] = Row.pack(class_index=CLASS_NAMES.index(s.cls), inode=ino, mtime=s.mtime,
                                  blocks=s.allocated_bytes // 512, apparent_bytes=s.apparent_bytes)
        states.append(STATES.index(s.state))
        if s.holders:
            held[ino] = s.holders
    return MountInventory(mount, names=tuple(listed), packed=tuple(listed.values()), states=bytes(states),
                          hidden=tuple(hidden), held=held, **fields)


# --- the budget behind the OOM projection ---------------------------------------------------
def usage(size, used, mount="/dev/shm"):
    return MountUsage(mount, "tmpfs", "tmpfs", True, size_bytes=size, used_bytes=used,
                      available_bytes=size - used)


def cgroup(working_set, limit, pod_uid=""):
    return CgroupMemory("/c", 1, working_set, limit, working_set, None, 0, "cgroup", pod_uid)


# --- the recommendation -----------------------------------------------------------------------
def view(u, cg=None, labels=None, max_used=None, budget_memory=None):
    return MountView(u.mount, labels or {}, u, None, max_used, None, None, None, cg,
                     shm_budget(u, cg, memory_limit=budget_memory))


KNOWN = Row.KNOWN


def pack(cls, flags, ino, mtime, blocks, size):
    """A row of these fields (`flags`: KNOWN or 0), by Row.pack."""
    return Row.pack(class_index=cls, inode=ino, mtime=mtime, blocks=blocks, apparent_bytes=size,
                    known=bool(flags & KNOWN))


def unpack(row):
    """(class index, inode, mtime, allocated bytes, apparent bytes), by Row's accessors."""
    return Row.class_index(row), Row.inode(row), Row.mtime(row), Row.allocated_bytes(row), Row.apparent_bytes(row)


# --- a listed file nobody holds ------------------------------------------------------------
DEV, INO = 41, 7
KEY = (DEV, INO)
KNOWN_ROW = pack(0, KNOWN, INO, 0, 8, 4096)  # listed before the last full scan read /proc


# --- where a cgroup's limit binds -----------------------------------------------------------
UID = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"


def cgroup_tree(root, limits, version=1):
    """kubepods/burstable/pod<UID>/ctr under `root`, each level's limit file written (None:
    unlimited), with a memory.stat; -> the container's directory."""
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    unlimited = "max" if version == 2 else str(9223372036854771712)
    directory = root
    for level, limit in zip(("kubepods", "burstable", f"pod{UID}", "ctr"), limits):
        directory = os.path.join(directory, level)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, name), "w") as f:
            f.write(f"{unlimited if limit is None else limit}\n")
        with open(os.path.join(directory, "memory.stat"), "w") as f:
            f.write("cache 0\n")
    return directory


def fixture(*parts):
    with open(os.path.join(FIXTURES, *parts)) as f:
        return f.read()


# Any text a hostile or broken /proc file could hand us (lone surrogates: what
# surrogateescape makes of bytes that are not UTF-8).
any_text = st.text(st.characters(codec=None, blacklist_categories=()), max_size=400)


# Path characters: anything but NUL and '/', which names cannot hold; the kernel writes
# space, tab, newline and backslash as \ooo octal and everything else raw.
path_char = st.characters(blacklist_characters="\0/", blacklist_categories=("Cs",))
path_component = st.text(path_char, min_size=1, max_size=12)
paths = st.lists(path_component, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts))


def pod_mount(root: str, uid: str, volume: str = "dshm") -> str:
    return f"{root}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/{volume}"


V1_MEMORY = "/sys/fs/cgroup/memory"


def segment(inv, mount, name):
    [m] = [m for m in inv.mounts if m.mount == mount]
    found = [s for s in m.rows() if s.name == name]
    return (found[0].state, found[0].holders) if found else None


def into_pod(cgroup, pid):
    with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
        f.write(str(pid))


class Clock:
    """The collector's monotonic clock, moved by the test: when the next full scan is due."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@contextlib.contextmanager
def orphan_attached_later(mount, script, allocated, cgroup=None):
    """`psm_known` in `mount` (4 MiB, its pages `allocated` or sparse), called orphan by node
    mode's first full scan, and a running process (in `cgroup`, when given) that runs `script`
    on it when told (`attach()`). `refresh()`: the state and holders the next run gives, 15 s
    on: a refresh, not a full scan."""
    clock = Clock()
    collector = SegmentsCollector(Paths(), ProcessTable(Paths()), pod_of_pid=True,
                                  full_scan_interval=600.0, monotonic=clock, ignore_unreadable=HOST_EXCUSED_RE)
    runs = Runs(collector, [mount])
    path = os.path.join(mount, "psm_known")
    with open(path, "wb") as f:
        f.write(b"x" * (4 * MiB)) if allocated else f.truncate(4 * MiB)
    child = subprocess.Popen([sys.executable, "-c", script, path], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        if cgroup is not None:
            into_pod(cgroup, child.pid)
        assert segment(runs.full(), mount, "psm_known") == ("orphan", ())

        def attach():
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline().strip() == "attached"

        def refresh():
            clock.now += 15
            return segment(runs.full(), mount, "psm_known")

        yield SimpleNamespace(collector=collector, runs=runs, pid=child.pid, attach=attach, refresh=refresh)
    finally:
        child.kill()
        child.wait()


WRITE_IN_PLACE = """
import mmap, os, sys
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR)
os.pwrite(fd, b"w" * 4096, 0)  # IN_MODIFY, and no page allocated: statvfs does not move
view = mmap.mmap(fd, 4 << 20)
print("attached", flush=True)
sys.stdin.readline()
"""
