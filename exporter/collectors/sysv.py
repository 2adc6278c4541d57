"""SysV shared memory: /proc/sysvipc/shm and kernel.shm* limits, per IPC namespace.
UCX's sysv transport and older MPI/NCCL builds use shmget(): never in /dev/shm, in no
common exporter (node_exporter issue 754). Both files show the *reader's* IPC namespace,
whatever procfs they are read through: a sidecar shares the server's; node mode joins
each (setns, CAP_SYS_ADMIN), else reports it unreadable, never an empty "all clear"."""

import os
import re
import threading
from contextlib import suppress
from dataclasses import replace
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

from exporter.model.types import SysvSegment, SysvShm
from exporter.collectors.source import Source, register
from exporter.host.libc import setns
from exporter.host.paths import Paths, read_text
from exporter.host.proctable import Process, ProcessTable

CLONE_NEWIPC = 0x08000000
# A container's ID in its cgroup path (Docker, containerd, CRI-O: 64 hex digits).
_CONTAINER_ID = re.compile(r"([0-9a-f]{64})")


def parse_sysvipc_shm(text: str) -> List[SysvSegment]:
    """Columns are found by the header's names (their order changed across kernels)."""
    header, *lines = text.splitlines() or [""]
    col = {name: i for i, name in enumerate(header.split())}
    if text and not {"key", "shmid", "size", "nattch"} <= col.keys():
        raise ValueError(
            "sysvipc/shm: unexpected header " + " ".join(header.split()[:8])
        )
    # SysvSegment's fields in order; a kernel without cpid, rss or lpid reads 0.
    names = ("key", "shmid", "size", "nattch", "cpid", "rss", "lpid")
    segments = []
    for fields in map(str.split, lines):
        with suppress(ValueError, IndexError):  # a truncated line
            row = [int(fields[col[n]]) if n in col else 0 for n in names]
            segments.append(SysvSegment(*row))
    return segments


def in_ipc_namespaces(
    namespaces: List[Tuple[str, List[str]]], read: Callable[[], object], timeout=5.0
) -> Dict[str, object]:
    """`read()` in each IPC namespace [(namespace, [paths that may join it])] -> namespace ->
    its result or the error that kept it unread, from one short-lived thread (setns moves only
    the calling thread). A path whose pid exited or is now elsewhere gives way to the next."""
    results: Dict[str, object] = {}

    def run() -> None:
        for namespace, paths in namespaces:
            try:
                for path in paths:
                    try:
                        ns = open(path, "rb", buffering=0)
                    except (FileNotFoundError, ProcessLookupError):
                        continue
                    with ns:
                        if f"ipc:[{os.fstat(ns.fileno()).st_ino}]" == namespace:
                            setns(ns.fileno(), CLONE_NEWIPC)
                            results[namespace] = read()
                            break
            except BaseException as err:  # handed to the caller's thread, without its
                # traceback: that holds this frame, so `results` (a cycle per namespace and
                # run, left to the cyclic collector: cli.tune_process)
                results[namespace] = err.with_traceback(None)

    thread = threading.Thread(target=run, name="shmwatch-sysv-ns", daemon=True)
    try:
        thread.start()
    except RuntimeError as err:  # no thread to be had (pids.max)
        return {namespace: err for namespace, _ in namespaces}
    thread.join(timeout)
    if thread.is_alive():
        for namespace, _ in namespaces:
            late = f"reading IPC namespace {namespace} took over {timeout:g}s"
            results.setdefault(namespace, TimeoutError(late))
    return dict(results)


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
        self.schedule = "inventory" if node_mode else "poll"
        self.stretches = node_mode

    def read(self) -> SysvShm:
        """The calling thread's IPC namespace."""
        gone = partial(self._gone, hidden=self.table.hidepid() != "off")
        # Attached by nobody; its creator and last user (0: never attached) exited.
        segments = [
            replace(s, orphan=True)
            if not s.nattch and gone(s.cpid) and (s.lpid == 0 or gone(s.lpid))
            else s
            for s in parse_sysvipc_shm(read_text(self.paths.proc("sysvipc", "shm")))
        ]
        shmmax, shmall, shmmni = map(self._kernel, ("shmmax", "shmall", "shmmni"))
        shmall = None if shmall is None else shmall * self.page_size  # in pages
        return SysvShm(segments, shmmax, shmall, shmmni)

    def collect(self) -> List[SysvShm]:
        """One namespace per element: ours in a sidecar; every process's in node mode."""
        if not self.node_mode:
            return [self.read()]
        own = os.readlink(self.paths.proc("self", "ns", "ipc"))
        processes = self.table.walk().processes
        links = {p: self.paths.proc(p.pid, "ns", "ipc") for p in processes}
        groups: Dict[str, List[Process]] = {}
        # Read afresh each run: `unshare --ipc` moves a process after it started.
        for proc, link in links.items():
            with suppress(OSError):  # gone or not ours: the inventory counts it
                groups.setdefault(os.readlink(link), []).append(proc)
        # shmwatch's own private namespace holds nobody's segments
        if {p.pid for p in groups.get(own, ())} == {os.getpid()}:
            del groups[own]
        shown = sorted(groups.items())
        joined = [(n, [links[p] for p in procs]) for n, procs in shown if n != own]
        read = in_ipc_namespaces(joined, self.read)
        out = []
        for namespace, procs in shown:
            try:
                shm = self.read() if namespace == own else read.get(namespace)
            except (OSError, ValueError) as err:
                shm = err
            if shm is None:
                continue  # every process of the namespace exited: so did the namespace
            # not read (OSError: a timeout too); any other error is a bug, raised here
            if isinstance(shm, (OSError, ValueError, RuntimeError)):
                shm = SysvShm([], None, None, None, readable=False, error=str(shm))
            elif isinstance(shm, BaseException):
                raise shm
            pods = {self.table.pod_uid(p) for p in procs}
            pod = pods.pop() if len(pods) == 1 else ""
            cid = "" if pod else self._container(procs)
            out.append(replace(shm, namespace=namespace, pod_uid=pod, container_id=cid))
        return out

    def _kernel(self, name: str) -> Optional[int]:
        with suppress(OSError, ValueError, IndexError):
            return int(read_text(self.paths.proc("sys", "kernel", name)).split()[0])
        return None

    def _gone(self, pid: int, hidden: bool) -> bool:
        """Exited? The kernel prints pids in our PID namespace (setns moves only the IPC
        one), 0 for one outside: unknown, not gone. Under hidepid a live pid may lack a
        /proc entry: only ESRCH from kill(pid, 0) proves it gone (EPERM: another's)."""
        if pid <= 0 or os.path.exists(self.paths.proc(pid)):
            return False
        try:
            if hidden:
                os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return not hidden

    def _container(self, procs: List[Process]) -> str:
        """The container ID of a namespace's first process, when its cgroup names one."""
        try:
            cgroups = self.table.cgroups(procs[0].pid)
        except OSError:
            return ""
        found = _CONTAINER_ID.search(cgroups.get("memory", cgroups.get("", "")))
        return found.group(1) if found else ""


register("sysv", lambda c: SysvCollector(c.paths, node_mode=c.node, table=c.table))
