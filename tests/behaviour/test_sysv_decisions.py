"""A SysV segment is an orphan, and `ipcrm` advised, only when nothing is attached and its
creator is proven gone: across the conditions that change what shmwatch can prove. The
creators are real processes (root's and the server's, in the PID namespace shmwatch reads and
in one below it) that made a segment, never attached, and live on or exited; shmwatch runs as
root, as another UID under each hidepid, in a PID namespace of its own (the kernel then
prints every creator's pid as 0: unknown, never gone), and in an IPC namespace of its own.

Each world (tests/peers/world.py) is a pod with an IPC namespace of its own, so nothing here
touches the host's SysV segments."""

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, Tuple

import pytest

from tests.conftest import needs_root, parse_exposition, value
from tests.helpers import run_world

pytestmark = needs_root

ROOT, SERVER, OTHER = 0, 1000, 65534
HIDEPID = {"off": "0", "noaccess": "1", "invisible": "2", "ptraceable": "4"}
# check's SysV advice (exporter/check/kernel.py's IPCRM): prose, not a line to paste
IPCRM = "remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"
# Three creators live on and three exited, one of each pair below shmwatch's PID namespace.
CREATORS = [
    dict(uid=uid, alive=alive, pidns=below)
    for uid, below in ((ROOT, False), (SERVER, False), (ROOT, True))
    for alive in (True, False)
]
GONE = sum(not c["alive"] for c in CREATORS)


@dataclass(frozen=True)
class Cell:
    uid: int  # shmwatch's
    segments: int  # what it lists
    orphans: int  # what it calls orphan
    pidns: bool = (
        False  # shmwatch in a PID namespace of its own, in the same IPC namespace
    )
    ipcns: bool = False  # shmwatch in an IPC namespace of its own
    serve: bool = False
    hidepid: Tuple[str, ...] = tuple(
        HIDEPID
    )  # the /proc options it runs under (its own /proc: off only)


CELLS: Dict[str, Cell] = {
    # In the creators' PID namespace: the exited ones are proven gone, whoever reads. Under
    # hidepid another UID's live creator has no /proc entry: kill(pid, 0) says EPERM, not
    # ESRCH. Root reads /proc whole under any hidepid: two cells of it suffice.
    "root": Cell(ROOT, len(CREATORS), GONE, serve=True, hidepid=("off",)),
    "root-under-ptraceable": Cell(ROOT, len(CREATORS), GONE, hidepid=("ptraceable",)),
    "other-uid": Cell(OTHER, len(CREATORS), GONE),
    "server-uid": Cell(
        SERVER, len(CREATORS), GONE, hidepid=("ptraceable",)
    ),  # sees its own only
    # A PID namespace of its own: /proc/sysvipc/shm shows every creator as pid 0. Unknown is
    # not gone: the live ones among them must never be ipcrm'ed.
    "root-own-pid-namespace": Cell(
        ROOT, len(CREATORS), 0, pidns=True, serve=True, hidepid=("off",)
    ),
    # Not sharing the creators' IPC namespace: their segments are not there to be seen.
    "root-own-ipc-namespace": Cell(ROOT, 0, 0, ipcns=True, hidepid=("off",)),
}


@lru_cache(maxsize=None)
def world(hidepid: str, python: str) -> Dict[str, Any]:
    exporters = {
        name: dict(
            uid=c.uid,
            python=python,
            ignore="",
            pidns=c.pidns,
            ipcns=c.ipcns,
            serve=c.serve,
        )
        for name, c in CELLS.items()
        if hidepid in c.hidepid
    }
    return run_world(dict(hidepid=HIDEPID[hidepid], sysv=CREATORS, exporters=exporters))


def sysv_finding(doc: Dict[str, Any]) -> Dict[str, Any]:
    """check's one SysV finding."""
    [found] = [f for f in doc["findings"] if f["area"] == "sysv"]
    assert isinstance(found, dict)
    return found


@pytest.mark.parametrize(
    "name, hidepid", [(n, h) for n, c in sorted(CELLS.items()) for h in c.hidepid]
)
def test_a_sysv_segment_is_an_orphan_only_when_its_creator_is_proven_gone(
    name: str, hidepid: str, nonroot_venv: str
) -> None:
    cell, report = CELLS[name], world(hidepid, nonroot_venv)
    run = report["runs"][name]
    doc = run["check"]
    assert isinstance(doc, dict), run["stderr"]
    facts = doc["sysv"]
    assert (facts["readable"], facts["segments"], facts["orphans"]) == (
        True,
        cell.segments,
        cell.orphans,
    ), facts
    said = sysv_finding(doc)
    assert said["severity"] == "ok" and said["message"].startswith(
        f"{cell.segments} segment(s)"
    ), said
    assert said["remedy"] == (IPCRM if cell.orphans else ""), said
    assert run["rc"] == 0, doc["findings"]  # a SysV orphan is advice, not a problem
    if cell.serve:
        samples = parse_exposition(run["metrics"])
        assert value(samples, "shmwatch_sysv_segments") == cell.segments
        assert value(samples, "shmwatch_sysv_orphan_segments") == cell.orphans


def test_the_world_shows_what_the_cells_rest_on(nonroot_venv: str) -> None:
    """pid 1 of the world reads every creator's pid (none 0); the cells below read 0 for all."""
    report = world("off", nonroot_venv)
    assert len(report["shmids"]) == len(CREATORS)
    assert all(int(cpid) > 0 for cpid in report["sysv_cpid"].values()), report[
        "sysv_cpid"
    ]
