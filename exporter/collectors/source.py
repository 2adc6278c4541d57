"""What a source is (`Source`, whole, with defaults) and its one registration point."""

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol, Set, Tuple

from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.inventory.changes import ChangeLog

# A stretched interval's cap, times its base (heavy sources; holdings.ScanPace's).
STRETCH_MAX = 8


class Source(Protocol):
    """Subclassed explicitly, a source takes these defaults."""

    name: str = ""
    schedule: str = "poll"  # or "inventory": every --poll- / --inventory-interval
    event_driven: bool = False  # collect_quick() soon after inotify sees a mount change
    stretches: bool = False  # heavy: its interval doubles while its result is the same
    follows_up: bool = True  # a full run follows quick runs (they left owners unread)
    reports_status: bool = True  # has shmwatch_collector_* series

    def collect(self) -> object:
        raise NotImplementedError

    def collect_quick(self) -> object:
        return self.collect()

    def begin_full(self) -> Optional[Callable[[], Callable[[], object]]]:
        """None, or a full run's first step: -> its middle (beside quick runs) -> its last."""
        return None

    def close(self) -> None:
        pass


@dataclass(frozen=True)
class Context:
    cfg: object  # exporter.config.Config
    paths: Paths
    mounts: Callable[[], List[str]]  # discovery's current mounts
    table: ProcessTable
    changes: ChangeLog  # names the watcher saw change
    touched: Optional[Callable[[], Set[str]]] = None  # mounts the watcher saw change
    all_watched: Callable[[], bool] = lambda: False  # inotify watches every mount
    kmsg_from_start: bool = False  # check: the kernel log from its start
    kill_log_complete: Callable[[], bool] = lambda: False  # every OOM kill is logged
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


def register(name: str, factory: Callable[[Context], Source], **options) -> None:
    REGISTRY[name] = Registration(name, factory, **options)
