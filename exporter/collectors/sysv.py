"""SysV shared memory: /proc/sysvipc/shm and kernel.shm* limits, per IPC namespace.
UCX's sysv transport and older MPI/NCCL builds use shmget(): never in /dev/shm, in no
common exporter (node_exporter issue 754). Both files show the *reader's* IPC namespace,
whatever procfs they are read through: a sidecar shares the server's; node mode joins
each (setns, CAP_SYS_ADMIN), else reports it unreadable, never an empty "all clear"."""

import os
import re
import threading
from contextlib import suppress
from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, TypeVar, Union

from exporter.model.types import SysvSegment, SysvShm
from exporter.collectors.source import RunInput, Schedule, Source, register
from exporter.host.libc import setns
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import Process, ProcessTable

CLONE_NEWIPC = 0x08000000
# A container's ID in its cgroup path (Docker, containerd, CRI-O: 64 hex digits).
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")
# Read failures that make a namespace's SysV "not readable"; any other error is a bug.
UNREADABLE = (OSError, ValueError, RuntimeError)
NAMESPACE_SECONDS = 5.0  # every IPC namespace read within this, on one thread
T = TypeVar("T")


def parse_sysvipc_shm(text: str) -> List[SysvSegment]:
    """Columns are found by the header's names (their order changed across kernels)."""
    header, *lines = text.splitlines() or [""]
    col = {name: i for i, name in enumerate(header.split())}
    if text and not {"key", "shmid", "size", "nattch"} <= col.keys():
        raise ValueError(
            "sysvipc/shm: unexpected header " + " ".join(header.split()[:8])
        )
    segments = []
    for fields in map(str.split, lines):
        with suppress(ValueError, IndexError):  # a truncated line
            segments.append(_segment(fields, col))
    return segments


def _orphan(segment: SysvSegment) -> bool:
    """Attached by nobody, and its creator and last user (0: never attached) proven gone."""
    if segment.nattch or not pid_gone(segment.cpid):
        return False
    return segment.lpid == 0 or pid_gone(segment.lpid)


def pid_gone(pid: int) -> bool:
    """Whether a pid of /proc/sysvipc/shm has exited. The kernel prints them in the reader's
    PID namespace whatever procfs the file is read through (setns moves only the IPC one),
    0 for one outside it: unknown, not gone; kill(pid, 0) asks that same namespace. Only
    ESRCH proves a pid gone: a /proc entry missing proves nothing (hidepid hides live
    processes, and how our procfs hides them may be unknown; another PID namespace's procfs
    lists other pids), EPERM is another UID's live process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _segment(fields: List[str], col: Dict[str, int]) -> SysvSegment:
    """A line's fields; a kernel without cpid, rss or lpid reads 0."""

    def number(name: str) -> int:
        return int(fields[col[name]]) if name in col else 0

    return SysvSegment(
        key=number("key"),
        shmid=number("shmid"),
        size_bytes=number("size"),
        nattch=number("nattch"),
        cpid=number("cpid"),
        rss_bytes=number("rss"),
        lpid=number("lpid"),
    )


@dataclass(frozen=True)
class IpcNamespace:
    """An IPC namespace ("ipc:[4026531839]"), and the /proc/<pid>/ns/ipc links that may
    join it (of its processes: one that exited or moved gives way to the next)."""

    namespace: str
    links: List[str]


def in_ipc_namespaces(
    namespaces: Sequence[IpcNamespace],
    read: Callable[[], T],
    timeout: float = NAMESPACE_SECONDS,
) -> Dict[str, Union[T, BaseException]]:
    """`read()` in each IPC namespace -> namespace -> its result or the error that kept it
    unread, from one short-lived thread (setns moves only the calling thread)."""
    results: Dict[str, Union[T, BaseException]] = {}
    thread = threading.Thread(
        target=_read_each,
        args=(namespaces, read, results),
        name="shmwatch-sysv-ns",
        daemon=True,
    )
    try:
        thread.start()
    except RuntimeError as err:  # no thread to be had (pids.max)
        return {ns.namespace: err for ns in namespaces}
    thread.join(timeout)
    if thread.is_alive():
        for ns in namespaces:
            late = f"reading IPC namespace {ns.namespace} took over {timeout:g}s"
            results.setdefault(ns.namespace, TimeoutError(late))
    return dict(results)


def _read_each(
    namespaces: Sequence[IpcNamespace],
    read: Callable[[], T],
    results: Dict[str, Union[T, BaseException]],
) -> None:
    """On the namespaces' own thread: each namespace joined in turn, and read."""
    for ns in namespaces:
        try:
            _read_in(ns, read, results)
        except BaseException as err:  # handed to the caller's thread, without its
            # traceback: that holds this frame, so `results` (a cycle per namespace and
            # run, left to the cyclic collector: cli.tune_process)
            results[ns.namespace] = err.with_traceback(None)


def _read_in(
    ns: IpcNamespace,
    read: Callable[[], T],
    results: Dict[str, Union[T, BaseException]],
) -> None:
    """Joins `ns` through the first of its links still in it, and reads; nothing when none is."""
    for link in ns.links:
        try:
            handle = open(link, "rb", buffering=0)
        except (FileNotFoundError, ProcessLookupError):
            continue
        with handle:
            if f"ipc:[{os.fstat(handle.fileno()).st_ino}]" == ns.namespace:
                setns(handle.fileno(), CLONE_NEWIPC)
                results[ns.namespace] = read()
                return


class SysvCollector(Source):
    name = "sysv"

    def __init__(
        self,
        paths: Paths,
        page_size: int = os.sysconf("SC_PAGE_SIZE"),
        node_mode: bool = False,
        table: Optional[ProcessTable] = None,
    ):
        self.paths = paths
        self.page_size = page_size
        self.node_mode = node_mode
        self.table = table or ProcessTable(paths)
        # Node mode walks every process for its namespace and joins each: at the inventory's
        # pace, stretched while nothing changes (SysV segments are long-lived).
        self.schedule: Schedule = "inventory" if node_mode else "poll"

    def stretches(self, run: RunInput) -> bool:
        return self.node_mode

    def read(self) -> SysvShm:
        """The calling thread's IPC namespace."""
        # Attached by nobody; its creator and last user (0: never attached) exited.
        segments = [
            replace(s, orphan=True) if _orphan(s) else s
            for s in parse_sysvipc_shm(read_text(self.paths.proc("sysvipc", "shm")))
        ]
        shmmax, shmall, shmmni = map(self._kernel, ("shmmax", "shmall", "shmmni"))
        return SysvShm(
            segments=segments,
            shmmax_bytes=shmmax,
            shmall_bytes=None
            if shmall is None
            else shmall * self.page_size,  # in pages
            shmmni=shmmni,
        )

    def collect(self, run: RunInput = RunInput()) -> List[SysvShm]:
        """One namespace per element: ours in a sidecar; every process's in node mode."""
        if not self.node_mode:
            return [self.read()]
        own = os.readlink(self.paths.proc("self", "ns", "ipc"))
        groups = self._processes_by_namespace(own)
        joined = [
            IpcNamespace(namespace=n, links=[self._link(p) for p in procs])
            for n, procs in groups.items()
            if n != own
        ]
        read = in_ipc_namespaces(joined, self.read)
        out = []
        for namespace, procs in groups.items():
            shm = self._own() if namespace == own else read.get(namespace)
            if shm is None:
                continue  # every process of the namespace exited: so did the namespace
            out.append(self._whose(self._readable(shm), namespace, procs))
        return out

    def _processes_by_namespace(self, own: str) -> Dict[str, List[Process]]:
        """Every process's IPC namespace (read afresh each run: `unshare --ipc` moves a
        process after it started), in order; shmwatch's own namespace left out when it is
        private (it holds nobody's segments)."""
        groups: Dict[str, List[Process]] = {}
        for proc in self.table.walk().processes:
            with suppress(OSError):  # gone or not ours: the inventory counts it
                groups.setdefault(os.readlink(self._link(proc)), []).append(proc)
        if {p.pid for p in groups.get(own, ())} == {os.getpid()}:
            del groups[own]
        return dict(sorted(groups.items()))

    def _link(self, proc: Process) -> str:
        return self.paths.proc(proc.pid, "ns", "ipc")

    def _own(self) -> Union[SysvShm, BaseException]:
        try:
            return self.read()
        except (OSError, ValueError) as err:
            return err

    @staticmethod
    def _readable(shm: Union[SysvShm, BaseException]) -> SysvShm:
        """A namespace not read (OSError: a timeout too) as unreadable; any other error is a
        bug, raised here."""
        if isinstance(shm, UNREADABLE):
            return SysvShm(
                segments=[],
                shmmax_bytes=None,
                shmall_bytes=None,
                shmmni=None,
                readable=False,
                error=str(shm),
            )
        if isinstance(shm, BaseException):
            raise shm
        return shm

    def _whose(self, shm: SysvShm, namespace: str, procs: List[Process]) -> SysvShm:
        """The namespace's pod (when its processes are of one), else its container."""
        pods = {self.table.pod_uid(p) for p in procs}
        pod = pods.pop() if len(pods) == 1 else ""
        cid = "" if pod else self._container(procs)
        return replace(shm, namespace=namespace, pod_uid=pod, container_id=cid)

    def close(self) -> None:
        """Nothing is kept open between runs."""

    def _kernel(self, name: str) -> Optional[int]:
        with suppress(OSError, ValueError, IndexError):
            return int(read_text(self.paths.proc("sys", "kernel", name)).split()[0])
        return None

    def _container(self, procs: List[Process]) -> str:
        """The container ID of a namespace's first process, when its cgroup names one."""
        try:
            cgroups = self.table.cgroups(procs[0].pid)
        except OSError:
            return ""
        found = _CONTAINER_ID.search(cgroups.get("memory", cgroups.get("", "")))
        return found.group(1) if found else ""


register("sysv", lambda c: SysvCollector(c.paths, node_mode=c.node, table=c.table))
