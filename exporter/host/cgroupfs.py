"""A memory cgroup's files (v1 and v2): where a mount shows them, read, parsed, and the
limit that binds it."""

import os
from contextlib import suppress
from dataclasses import dataclass
from typing import AbstractSet, Dict, Iterable, List, Optional, Tuple

from exporter.host.kube import POD_CGROUP_DIR
from exporter.host.mountinfo import MountEntry
from exporter.host.paths import read_text

# A v1 limit at or above 2^62 is none (v1 writes PAGE_COUNTER_MAX pages: 9223372036854771712 B).
V1_UNLIMITED = 1 << 62
USAGE = {1: "memory.usage_in_bytes", 2: "memory.current"}
LIMIT = {1: "memory.limit_in_bytes", 2: "memory.max"}


@dataclass(frozen=True)
class Hierarchy:
    """Where a cgroup hierarchy with the memory controller is mounted below /sys/fs/cgroup."""

    directory: str
    version: int

    @property
    def controller(self) -> str:
        """Its name in /proc/<pid>/cgroup: v1's "memory", v2's "" ('0::/path')."""
        return "memory" if self.version == 1 else ""


# v1 (a hybrid host's first), v2, and v2 under a hybrid host's "unified".
HIERARCHIES = (
    Hierarchy(directory="memory", version=1),
    Hierarchy(directory="", version=2),
    Hierarchy(directory="unified", version=2),
)
STAT_KEYS = frozenset(  # what read_files parses of memory.stat (v1's and v2's)
    "inactive_file shmem swap hierarchical_memory_limit total_inactive_file "
    "total_shmem total_swap".split()
)


@dataclass(frozen=True)
class LevelLimit:
    """One cgroup directory's own limit (None: unlimited or no file)."""

    directory: str
    limit_bytes: Optional[int]


@dataclass(frozen=True)
class BindingLimit:
    """The limit the kernel enforces on a cgroup, and where it binds: "pod" (a pod's cgroup,
    the cgroup itself or above it), "self", "ancestor", "none"; collectors add "flag"."""

    limit_bytes: Optional[int]
    limit_source: str


# Directory above a cgroup -> the limits from it up (node mode's pods share their QoS slices).
LimitsAbove = Dict[str, Tuple[LevelLimit, ...]]


@dataclass(frozen=True)
class CgroupFiles:
    """What a memory cgroup's files say (v1 or v2), in CgroupMemory's terms."""

    usage_bytes: int
    limit: BindingLimit
    working_set_bytes: int
    shmem_bytes: Optional[int]
    oom_kills: Optional[int]  # None where not counted (v1 before 4.13)
    high_bytes: Optional[int]  # v2's memory.high
    events: Tuple[Tuple[str, int], ...]  # memory.events (v1: oom_kill, failcnt as max)
    swap_bytes: Optional[int]
    swap_limit_bytes: Optional[int]


def parse_flat_keyed(
    text: str, keys: Optional[AbstractSet[str]] = None
) -> Dict[str, int]:
    """'anon 123\\nfile 456' (memory.stat, .events, oom_control) -> dict, of `keys` if given."""
    values: Dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and (keys is None or parts[0] in keys):
            with suppress(ValueError):
                values[parts[0]] = int(parts[1])
    return values


def parse_limit(text: str) -> Optional[int]:
    number = V1_UNLIMITED if text.strip() == "max" else int(text)
    return None if number >= V1_UNLIMITED else number


def read_limit(directory: str, name: str) -> Optional[int]:
    """A limit file (memory.max, .high, .swap.max, limit_in_bytes) or a counter (failcnt,
    swap.current); None when the cgroup has no such file (a root, an older kernel, no swap
    accounting) or it says unlimited."""
    with suppress(FileNotFoundError):
        return parse_limit(read_text(os.path.join(directory, name)))
    return None


def read_flat_keyed(directory: str, name: str) -> Dict[str, int]:
    """A flat keyed file (memory.events, memory.oom_control); {} when the cgroup has none."""
    with suppress(FileNotFoundError):
        return parse_flat_keyed(read_text(os.path.join(directory, name)))
    return {}


def limits_above(level: str, name: str, above: LimitsAbove) -> Tuple[LevelLimit, ...]:
    """The limit of each cgroup above `level` up to the top of what is mounted, nearest
    first, memoized in `above` (node mode's pods share their QoS slices: read once a pass)."""
    parent = os.path.dirname(os.path.normpath(level))  # a ns root: ".../cgroup/"
    if parent not in above:
        top = parent == level or not os.path.exists(os.path.join(parent, name))
        if top:
            above[parent] = ()
        else:
            own = LevelLimit(directory=parent, limit_bytes=read_limit(parent, name))
            above[parent] = (own, *limits_above(parent, name, above))
    return above[parent]


def effective_limit(
    directory: str, version: int, above: Optional[LimitsAbove] = None
) -> BindingLimit:
    """The smallest limit from the cgroup up, as the kernel enforces it (v2 has no
    hierarchical_memory_limit; a pod-level limit, KEP-2837, is on the pod's cgroup alone),
    and where it binds; of equal limits the outermost (a container as tight as its pod is
    read as the pod)."""
    name = LIMIT[version]
    best = BindingLimit(limit_bytes=None, limit_source="none")
    own = LevelLimit(directory=directory, limit_bytes=read_limit(directory, name))
    chain = limits_above(directory, name, {} if above is None else above)
    for level in (own, *chain):
        limit = level.limit_bytes
        if limit is not None and (
            best.limit_bytes is None or limit <= best.limit_bytes
        ):
            best = BindingLimit(
                limit_bytes=limit, limit_source=_bound_at(level, directory)
            )
    return best


def _bound_at(level: LevelLimit, directory: str) -> str:
    """Where a limit read at `level` binds the cgroup at `directory`."""
    if POD_CGROUP_DIR.search(os.path.basename(level.directory)):
        return "pod"
    return "self" if level.directory == directory else "ancestor"


def read_files(
    directory: str,
    version: int,
    above: Optional[LimitsAbove] = None,
    with_swap: bool = True,
) -> CgroupFiles:
    """A cgroup's files; `with_swap`: v2's swap files are read (a node without swap: not)."""
    stat = parse_flat_keyed(read_text(f"{directory}/memory.stat"), STAT_KEYS)
    # v1's total_* fields include descendants (use_hierarchy, always on since 5.x).
    stat.update({k[6:]: v for k, v in list(stat.items()) if k.startswith("total_")})
    limit = effective_limit(directory, version, above)
    usage = int(read_text(os.path.join(directory, USAGE[version])))
    if version == 2:
        return _v2_files(directory, stat, limit, usage, with_swap)
    return _v1_files(directory, stat, limit, usage)


def _v2_files(
    directory: str,
    stat: Dict[str, int],
    limit: BindingLimit,
    usage: int,
    with_swap: bool,
) -> CgroupFiles:
    events = read_flat_keyed(directory, "memory.events")
    high = read_limit(directory, "memory.high")
    swap = swap_limit = None  # a node without swap: not read, not exported
    if with_swap:
        swap = read_limit(directory, "memory.swap.current")
        swap_limit = read_limit(directory, "memory.swap.max")
    return CgroupFiles(
        usage_bytes=usage,
        limit=limit,
        working_set_bytes=_working_set(usage, stat),
        shmem_bytes=stat.get("shmem"),
        oom_kills=events.get("oom_kill"),
        high_bytes=high,
        events=tuple(sorted(events.items())),
        swap_bytes=swap,
        swap_limit_bytes=swap_limit,
    )


def _v1_files(
    directory: str, stat: Dict[str, int], limit: BindingLimit, usage: int
) -> CgroupFiles:
    # Above what this namespace mounts, memory.stat still knows the tightest limit.
    hierarchical = stat.get("hierarchical_memory_limit", V1_UNLIMITED)
    if hierarchical < V1_UNLIMITED and (
        limit.limit_bytes is None or hierarchical < limit.limit_bytes
    ):
        limit = BindingLimit(limit_bytes=hierarchical, limit_source="ancestor")
    control = read_flat_keyed(directory, "memory.oom_control")
    failcnt = read_limit(directory, "memory.failcnt")  # hits of the limit: v2's max
    events = {"oom_kill": control.get("oom_kill"), "max": failcnt}
    counted = {k: v for k, v in events.items() if v is not None}
    return CgroupFiles(
        usage_bytes=usage,
        limit=limit,
        working_set_bytes=_working_set(usage, stat),
        shmem_bytes=stat.get("shmem"),
        oom_kills=counted.get("oom_kill"),
        high_bytes=None,
        events=tuple(sorted(counted.items())),
        swap_bytes=stat.get("swap"),
        swap_limit_bytes=None,
    )


def _working_set(usage: int, stat: Dict[str, int]) -> int:
    """What the kubelet and the OOM killer compare: usage less inactive file pages."""
    return max(0, usage - stat.get("inactive_file", 0))


def below(path: str, root: str) -> Optional[List[str]]:
    """`path`'s components below `root`, both relative to one cgroup namespace root (either may
    climb out of it with leading '..'); None when `path` is not at or below `root`."""
    above = "/\0" * 64 + "/"  # stand-ins for directories above the namespace root
    p, r = (os.path.normpath(above + t).split("/")[1:] for t in (path, root))
    if p[: len(r)] != r or any(part.startswith("\0") for part in p[len(r) :]):
        # Not below the mount, or below it through directories whose names this namespace
        # cannot tell (a v2 path /../<id> under a mount rooted at /../..): not guessed.
        return None
    return p[len(r) :]


def cgroup_directories(
    entries: Iterable[MountEntry], path: str, version: int
) -> List[str]:
    """Every directory a mounted cgroupfs shows `path` at (v1: a memory hierarchy; v2: cgroup2):
    /proc/<pid>/cgroup is relative to the cgroup namespace's root, a mount shows the subtree
    below its mountinfo root (e.g. the host's cgroupfs given read-only to a sidecar)."""
    out = []
    for entry in entries:
        v1 = entry.fstype == "cgroup" and "memory" in entry.options.split(",")
        rest = below(path, entry.root)
        if rest is not None and (v1 if version == 1 else entry.fstype == "cgroup2"):
            out.append(os.path.join(entry.mount_point, *rest))
    return out
