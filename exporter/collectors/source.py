"""What a source is (`Source`, whole, with defaults), what each of its runs is handed
(`RunInput`), and its one registration point (`register`).

A run is handed everything it needs from other parts as a `RunInput` the scheduler makes when
the run begins: the mounts discovery last published, the names inotify saw change, whether
inotify watches every mount, whether the kernel log counts every OOM kill. A source never
calls into another part to ask, nor is it called back.
"""

from dataclasses import dataclass, field
from typing import AbstractSet, Callable, Dict, Literal, Mapping, Optional, Protocol
from typing import Tuple

from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable

# A stretched interval's cap, times its base (heavy sources; holdings.ScanPace's).
STRETCH_MAX = 8

# "poll": every --poll-interval; "inventory": every --inventory-interval.
Schedule = Literal["poll", "inventory"]
# Per mount, the names inotify saw change in its top directory; None: anything may have
# changed (below the top directory, too many names, events lost): list it all again.
NamesChanged = Mapping[str, Optional[AbstractSet[str]]]


@dataclass(frozen=True)
class RunInput:
    """What one run of a source is handed, as it stood when the run began (made by the
    scheduler on the source's thread; frozen: nobody changes it after)."""

    # The mounts to look at: the set discovery last published (in a sidecar, --shm.mount).
    mounts: Tuple[str, ...] = ()
    # What inotify named since a run of this source last took the names: a full or quick
    # run takes them; a staged full run's stages only look (its quick runs take them).
    changes: NamesChanged = field(default_factory=dict)
    # inotify watches every mount: nothing changes unseen (a polled mount can).
    all_watched: bool = False
    # The kernel log is read and its last read lost nothing: it counts every OOM kill.
    kill_log_complete: bool = False

    @property
    def touched(self) -> AbstractSet[str]:
        """The mounts inotify saw change."""
        return self.changes.keys()


class StagedRun(Protocol):
    """A full run in stages, for a source whose full run has a slow middle that reads no
    mount (node mode's owner scan: every process's /proc). `Source.begin_full` makes it on
    the source's thread (its first stage); the scheduler calls `scan` on a thread of its own
    while quick runs go on (or on the source's thread), then `finish` back on the source's
    thread, so that one thread publishes."""

    def scan(self) -> None:
        """The slow middle. Never raises: what went wrong is raised by `finish`."""

    def finish(self, run: RunInput) -> object:
        """The last stage: the run's result. `run.changes`: names changed and not yet taken
        by a quick run (they may have changed while `scan` read /proc)."""

    def abandon(self) -> None:
        """Instead of `scan` and `finish`, on the source's thread: the scan could not start
        (no thread to be had); what the first stage left for the others is undone."""


class Source(Protocol):
    """One source of observations. Subclassed explicitly, a source takes these defaults."""

    name: str = ""
    schedule: Schedule = "poll"
    event_driven: bool = False  # collect_quick() soon after inotify sees a mount change
    follows_up: bool = True  # a full run follows quick runs (they left owners unread)
    reports_status: bool = True  # has shmwatch_collector_* series
    # Its staged full run's scan runs on a thread of its own, beside quick runs; else on
    # the source's thread, between begin_full and finish.
    scans_beside_quick_runs: bool = False

    def stretches(self, run: RunInput) -> bool:
        """Heavy: after a full run whose result is the last one's, its interval doubles
        (up to STRETCH_MAX times the base); asked after each full run, with its input."""
        return False

    def collect(self, run: RunInput) -> object:
        """A full run: the source's typed result (model/types.py)."""
        raise NotImplementedError

    def collect_quick(self, run: RunInput) -> object:
        """An event-driven run: what `run.changes` names, the rest as the last run left it."""
        return self.collect(run)

    def begin_full(self, run: RunInput) -> Optional[StagedRun]:
        """None, or a full run in stages (then `collect` is not called for full runs)."""
        return None

    def close(self) -> None:
        """What the source keeps open between runs, closed (never while a run is busy)."""
        return None


class SourceFlags(Protocol):
    """What sources read of the configuration: exporter.config.Config has each field (App
    hands it over as this). A Protocol, not Config: config imports the registry below to
    declare --[no-]collector.<name>, so config cannot be imported here."""

    @property
    def mode(self) -> str: ...

    @property
    def ignore_unreadable(self) -> Optional[str]: ...

    @property
    def full_scan_interval(self) -> float: ...

    @property
    def max_segments(self) -> int: ...

    @property
    def cgroup_path(self) -> Optional[str]: ...

    @property
    def cgroup_target_process(self) -> Optional[str]: ...

    @property
    def kmsg(self) -> str: ...


@dataclass(frozen=True)
class Context:
    """What a source's factory is given: fixed for the process's life (what changes from run
    to run comes in each RunInput)."""

    cfg: SourceFlags
    paths: Paths
    table: ProcessTable  # one process table, shared by the sources that read /proc
    kmsg_from_start: bool = False  # check: the kernel log from its start
    memory_limit: Optional[int] = None  # --memory.limit-bytes < MemTotal, else None

    @property
    def node(self) -> bool:
        return self.cfg.mode == "node"


@dataclass(frozen=True)
class Registration:
    name: str
    factory: Callable[[Context], Source]
    modes: Tuple[str, ...] = ("sidecar", "node")  # on by default in these modes
    flag: bool = True  # switched by --[no-]collector.<name>


REGISTRY: Dict[str, Registration] = {}  # in the order their series are rendered


def register(
    name: str,
    factory: Callable[[Context], Source],
    modes: Tuple[str, ...] = ("sidecar", "node"),
    flag: bool = True,
) -> None:
    REGISTRY[name] = Registration(name=name, factory=factory, modes=modes, flag=flag)
