"""A segment's state (linked / hidden / orphan / unverified) and the `rm` advice, across the
kernel conditions that change them: /proc's hidepid (off, noaccess, invisible, ptraceable);
shmwatch as root, as the server's UID, as another UID; holders root's and the server's, in the
PID namespace shmwatch reads or one below it; shmwatch in a PID namespace of its own;
--segments.ignore-unreadable and whom it may excuse.

Each world (tests/peers/world.py) is a pod of its own: pid 1 is root's 'pause', /dev/shm a
fresh tmpfs, /proc a fresh procfs with the cell's hidepid; the segments are real files held
by real processes under real UIDs, and the leak a file whose creator exited. What shmwatch
says is what `shmwatch check --output=json` says (its facts, its advice, its exit code), and
for the ptraceable cells /metrics too. The rule throughout: a segment is `orphan`, and `rm`
advised, only when every process that could hold it was read."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, FrozenSet, Tuple

import pytest

from tests.conftest import needs_root, parse_exposition, select
from tests.helpers import mount_facts, removal_advised, run_world

pytestmark = needs_root

MiB = 1 << 20
ROOT, SERVER, OTHER = (
    0,
    1000,
    65534,
)  # the server runs as 1000; 65534 is the image's user
HIDEPID = {"off": "0", "noaccess": "1", "invisible": "2", "ptraceable": "4"}
PAUSE = (
    "^pause$"  # an operator excuses the pod's root pid 1 (--segments.ignore-unreadable)
)
PAUSE_AND_SHIM = "^(pause|unshare)$"  # and the root parent of a PID namespace below
LINKED, ORPHAN, UNVERIFIED = "linked", "orphan", "unverified"
LEAK = "nccl-leaked01"


def holder(mode: str, name: str, uid: int, **extra: Any) -> Dict[str, Any]:
    return dict(mode=mode, name=name, size=MiB, uid=uid, **extra)


def left(name: str, uid: int, **extra: Any) -> Dict[str, Any]:
    return dict(name=name, size=MiB, uid=uid, **extra)


def mixed(pidns: bool = False) -> Dict[str, Any]:
    """A root process's live segment, the server's live and hidden ones, and a leak the
    server left (pidns: each made in a PID namespace below the one shmwatch reads)."""
    return dict(
        holders=[
            holder("mapped", "nccl-root0001", ROOT, pidns=pidns),
            holder("mapped", "psm_server01", SERVER, pidns=pidns),
            holder("hidden", "nccl-hidden01", SERVER, pidns=pidns),
        ],
        left=[left(LEAK, SERVER, pidns=pidns)],
    )


def server_only(pidns: bool = False, *more: Dict[str, Any]) -> Dict[str, Any]:
    """The server's live and hidden segments and its leak; no other process but pid 1."""
    return dict(
        holders=[
            holder("mapped", "psm_server01", SERVER, pidns=pidns),
            holder("hidden", "nccl-hidden01", SERVER, pidns=pidns),
            *more,
        ],
        left=[left(LEAK, SERVER, pidns=pidns)],
    )


@dataclass(frozen=True)
class Expect:
    states: Dict[str, str]  # each listed file's state
    hidden_seen: bool  # the server's unlinked-but-mapped segment found
    rm: FrozenSet[str] = frozenset()  # the names `rm` is advised for
    exit_code: int = 0

    @property
    def listed(self) -> Tuple[str, ...]:
        return tuple(self.states)


ALL_READ = Expect(
    {"nccl-root0001": LINKED, "psm_server01": LINKED, LEAK: ORPHAN},
    True,
    frozenset({LEAK}),
    1,
)
NONE_READ = Expect(
    {"nccl-root0001": UNVERIFIED, "psm_server01": UNVERIFIED, LEAK: UNVERIFIED}, False
)
OWN_READ = Expect(
    {"nccl-root0001": UNVERIFIED, "psm_server01": LINKED, LEAK: UNVERIFIED}, True
)
SERVER_PROVEN = Expect(
    {"psm_server01": LINKED, LEAK: ORPHAN}, True, frozenset({LEAK}), 1
)
SERVER_UNPROVEN = Expect({"psm_server01": LINKED, LEAK: UNVERIFIED}, True)


@dataclass(frozen=True)
class Cell:
    world: str  # a key of WORLDS
    uid: int  # shmwatch's
    expect: Expect
    ignore: str = PAUSE
    pidns: bool = False  # shmwatch in a PID namespace of its own
    sidecar: bool = (
        False  # check run beside a shmwatch serving in a PID namespace of its own
    )
    serve: bool = False  # /metrics too


def _worlds() -> Dict[str, Dict[str, Any]]:
    worlds = {f"mixed/{name}": dict(mixed(), hidepid=h) for name, h in HIDEPID.items()}
    worlds.update(
        {
            f"server-only/{name}": dict(server_only(), hidepid=h)
            for name, h in HIDEPID.items()
        }
    )
    # Any process may name itself 'pause' (PR_SET_NAME): one of another UID holds a segment.
    # Any process may also make itself not dumpable: its /proc files are then root's.
    named = holder("mapped", "psm_other01", OTHER, comm="pause")
    hiding = holder("mapped", "psm_other02", OTHER, comm="pause", undumpable=True)
    worlds["server-only+other-named-pause/off"] = dict(
        server_only(False, named, hiding), hidepid="0"
    )
    worlds["mixed-below/off"] = dict(mixed(pidns=True), hidepid="0")
    worlds["server-only-below/off"] = dict(server_only(pidns=True), hidepid="0")
    return worlds


WORLDS = _worlds()
CELLS: Dict[str, Cell] = {}
for _name in HIDEPID:
    # Root reads every process whatever hidepid says; another UID none of root's nor the
    # server's; the server's UID its own only. hidepid changes how the unread are found
    # (stat refused, not listed, not ptraceable), never the verdict.
    CELLS[f"mixed/{_name}/root"] = Cell(
        f"mixed/{_name}", ROOT, ALL_READ, serve=_name == "ptraceable"
    )
    CELLS[f"mixed/{_name}/other-uid"] = Cell(
        f"mixed/{_name}", OTHER, NONE_READ, serve=_name == "ptraceable"
    )
    CELLS[f"mixed/{_name}/server-uid"] = Cell(
        f"mixed/{_name}", SERVER, OWN_READ, serve=_name == "ptraceable"
    )
    # The server's UID and only the excused pid 1 besides: proven only where pid 1 can be
    # named; noaccess refuses its stat, invisible and ptraceable do not list it.
    CELLS[f"server-only/{_name}/server-uid"] = Cell(
        f"server-only/{_name}",
        SERVER,
        SERVER_PROVEN if _name == "off" else SERVER_UNPROVEN,
    )
# Nobody excused: pid 1 unread.
CELLS["server-only/off/server-uid/nothing-excused"] = Cell(
    "server-only/off", SERVER, SERVER_UNPROVEN, ignore=""
)
# A process of another UID named as the excused one: not excused (only root's may be).
CELLS["server-only+other-named-pause/off/server-uid"] = Cell(
    "server-only+other-named-pause/off",
    SERVER,
    Expect(
        {
            "psm_server01": LINKED,
            "psm_other01": UNVERIFIED,
            "psm_other02": UNVERIFIED,
            LEAK: UNVERIFIED,
        },
        True,
    ),
)
# Holders in a PID namespace below shmwatch's: read through their pids there.
CELLS["mixed-below/off/root"] = Cell("mixed-below/off", ROOT, ALL_READ)
CELLS["server-only-below/off/server-uid"] = Cell(
    "server-only-below/off", SERVER, SERVER_PROVEN, ignore=PAUSE_AND_SHIM
)
# shmwatch in a PID namespace of its own (a sidecar without shareProcessNamespace) sees
# only itself: nothing proven, even as root. Also when `shmwatch check` is run in such a
# sidecar beside the shmwatch serving there (kubectl exec): that one is no workload either.
CELLS["mixed/off/root-own-pid-namespace"] = Cell(
    "mixed/off", ROOT, NONE_READ, pidns=True
)
CELLS["mixed/off/root-exec-into-sidecar"] = Cell(
    "mixed/off", ROOT, NONE_READ, sidecar=True
)


def exporter_of(cell: Cell, python: str) -> Dict[str, Any]:
    return dict(
        uid=cell.uid,
        python=python,
        ignore=cell.ignore,
        pidns=cell.pidns,
        sidecar=cell.sidecar,
        serve=cell.serve,
    )


@lru_cache(maxsize=None)
def _world_report(world: str, python: str) -> Dict[str, Any]:
    """One run of `world` with every cell of it: each cell's check (and scrape)."""
    cells = {name: cell for name, cell in CELLS.items() if cell.world == world}
    spec = dict(
        WORLDS[world],
        exporters={name: exporter_of(cell, python) for name, cell in cells.items()},
    )
    return run_world(spec)


def states_said(doc: Dict[str, Any], listed: Tuple[str, ...]) -> Dict[str, str]:
    """Each listed file's state as check's facts give it: orphan, unverified, else linked
    (held: the segment count says none is missing)."""
    facts = mount_facts(doc)
    orphans = {o["name"] for o in facts["orphans"]}
    unverified = {u["name"] for u in facts["unverified"]}
    return {
        n: ORPHAN if n in orphans else UNVERIFIED if n in unverified else LINKED
        for n in listed
    }


def states_scraped(text: str) -> Dict[str, float]:
    """state -> segments of /dev/shm, from /metrics (hidden included)."""
    out: Dict[str, float] = {}
    for labels, v in select(
        parse_exposition(text), "shmwatch_segments", mount="/dev/shm"
    ):
        out[labels["state"]] = out.get(labels["state"], 0) + v
    return {state: n for state, n in out.items() if n}


@pytest.mark.parametrize("name", sorted(CELLS))
def test_a_segment_is_called_leaked_only_when_every_process_that_could_hold_it_was_read(
    name: str, nonroot_venv: str
) -> None:
    cell = CELLS[name]
    run = _world_report(cell.world, nonroot_venv)["runs"][name]
    doc, want = run["check"], cell.expect
    assert isinstance(doc, dict), run["stderr"]
    facts = mount_facts(doc)
    said = (facts, doc["findings"], run["stderr"])  # what a failure shows
    assert facts["segments"] == len(want.listed) + want.hidden_seen, said
    assert states_said(doc, want.listed) == want.states, said
    assert (facts["hidden_bytes"] == MiB) == want.hidden_seen, said
    assert removal_advised(doc) == {f"/dev/shm/{n}" for n in want.rm}, doc["findings"]
    assert run["rc"] == doc["exit_code"] == want.exit_code, doc["findings"]
    if ORPHAN not in want.states.values():
        # Unverified ones are said to be, with whom shmwatch could not read and how to fix it.
        [unverified] = [
            f
            for f in doc["findings"]
            if "not called leaked, they may be live" in f["message"]
        ]
        assert unverified["severity"] == "info", unverified
        assert "never remove them" in unverified["remedy"], unverified
    if cell.serve:
        # What Prometheus sees (ShmLeakedSegments reads state="orphan") agrees.
        counts = [
            list(want.states.values()).count(s) for s in (LINKED, ORPHAN, UNVERIFIED)
        ]
        want_scraped = {
            s: float(n) for s, n in zip((LINKED, ORPHAN, UNVERIFIED), counts) if n
        }
        if want.hidden_seen:
            want_scraped["hidden"] = 1.0
        assert states_scraped(run["metrics"]) == want_scraped
