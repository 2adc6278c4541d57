# mypy: allow-untyped-calls
"""What one owner scan found, as the inventory reads it: a holder's bytes and sizes, which
segments may be called leaked, which pods a refresh reads again, and when the next full
scan is (node mode). Fast and fixture-free: part of the mutation-testing selection."""

import logging
from typing import Dict, Optional, Tuple

import pytest

from exporter.inventory.holdings import (
    MAX_UNPROVEN,
    Changes,
    Holding,
    Owners,
    ScanPace,
    Sizes,
    UnprovenLog,
    add_names,
    joined,
    mounts_to_reread,
    orphan_bytes,
    unheld_state,
    unlinked_size,
)
from exporter.inventory.walk import Listing
from exporter.model.types import PackedRow, Row
from tests.helpers import DEV, INO, KEY, KNOWN_ROW

Listings = Dict[str, Listing]  # each mount's listing
POD = "11111111-2222-3333-4444-555555555555"
POD_MOUNT = f"/var/lib/kubelet/pods/{POD}/volumes/kubernetes.io~empty-dir/dshm"
HOST_MOUNT = "/dev/shm"


def test_one_process_holding_a_segment_twice_is_one_holder_with_the_most_it_reaches() -> (
    None
):
    """A map and an fd of one inode by one pid: one holding, the furthest extent, deleted if
    either says so, the first mapping's range, the stat's sizes; another pid is another."""
    owners = Owners()
    key = (40, 7)
    owners.hold(key, Holding(10, "/dev/shm/torch_1", False, 4096, "1000-2000"))
    owners.hold(
        key,
        Holding(
            10,
            "/dev/shm/torch_1 (deleted)",
            True,
            8192,
            "3000-5000",
            Sizes(allocated_bytes=16384, apparent_bytes=8192, mtime=5.0),
        ),
    )
    owners.hold(key, Holding(10, "/dev/shm/torch_1", False, 1024, "", None))
    owners.hold(key, Holding(11, "/dev/shm/torch_1", False, 512))
    first, second = owners.holdings[key]
    assert (first.pid, first.extent, first.deleted, first.map_range, first.sizes) == (
        10,
        8192,
        True,
        "1000-2000",
        Sizes(allocated_bytes=16384, apparent_bytes=8192, mtime=5.0),
    )
    assert (second.pid, second.extent, second.deleted) == (11, 512, False)
    assert owners.keys_of == {10: [key], 11: [key]}


def test_a_holding_without_a_range_takes_the_next_ones() -> None:
    owners = Owners()
    owners.hold((1, 2), Holding(5, "/x", False, 0, ""))
    owners.hold((1, 2), Holding(5, "/x", False, 0, "a-b"))
    assert owners.holdings[(1, 2)][0].map_range == "a-b"


def test_why_unheld_is_not_proven_is_kept_up_to_a_bound() -> None:
    owners = Owners()
    for pid in range(MAX_UNPROVEN + 5):
        owners.unproven_because(f"python3 (pid {pid}, uid 1000)")
    assert len(owners.unproven) == MAX_UNPROVEN == 20
    assert owners.unproven[-1] == "python3 (pid 19, uid 1000)"


@pytest.mark.parametrize(
    "unverifiable, complete", [(0, True), (1, False), (None, False)]
)
def test_orphans_only_when_every_process_that_could_hold_one_was_read(
    unverifiable: Optional[int], complete: bool
) -> None:
    assert Owners(unverifiable=unverifiable).complete is complete


def test_an_unlinked_segments_size_is_a_stats_else_its_furthest_mapping() -> None:
    stat = Sizes(allocated_bytes=8192, apparent_bytes=4096, mtime=7.5)
    hs = [
        Holding(1, "/a", True, 100),
        Holding(2, "/a", True, 300, sizes=stat),
        Holding(3, "/a", True, 900),
    ]
    assert unlinked_size(hs) == stat
    assert unlinked_size(
        [Holding(1, "/a", True, 100), Holding(2, "/a", True, 300)]
    ) == Sizes(allocated_bytes=300, apparent_bytes=300, mtime=0.0)


def test_names_changed_where_none_is_any_name() -> None:
    assert joined({"a"}, {"b"}) == {"a", "b"}
    assert joined(None, {"b"}) is None and joined({"a"}, None) is None
    book: Changes = {}
    add_names(book, "/m", {"a"})
    add_names(book, "/m", {"b"})
    assert book == {"/m": {"a", "b"}}
    add_names(book, "/m", None)
    add_names(book, "/m", {"c"})
    assert book == {"/m": None}  # re-list it all, whatever comes after
    add_names(book, "/n", set())
    assert book["/n"] == set()


def row(allocated: int) -> PackedRow:
    """A listed file with `allocated` bytes (its apparent size one page more: sparse)."""
    return Row.pack(
        0, inode=7, mtime=0, blocks=allocated // 512, apparent_bytes=allocated + 4096
    )


def listing(**rows: int) -> Listing:
    out = Listing()
    out.rows = {name: row(allocated) for name, allocated in rows.items()}
    return out


def test_an_orphans_bytes_are_its_allocated_ones_or_none_when_not_listed() -> None:
    assert orphan_bytes({"a": row(4096), "b": row(0)}, ["a", "b", "c"]) == {
        "a": 4096,
        "b": 0,
        "c": None,
    }


def test_a_refresh_reads_the_pod_of_an_orphan_written_through_a_mapping() -> None:
    devs = {POD_MOUNT: 40}
    listings: Listings = {POD_MOUNT: listing(psm_a=8192, psm_b=4096, psm_new=4096)}
    orphans = {POD_MOUNT: {"psm_a", "psm_b", "psm_gone"}}
    read_as = {POD_MOUNT: {"psm_a": 4096, "psm_b": 4096}}
    # psm_a grew since its pod was read (pages written, no event); psm_b did not; psm_gone is gone.
    assert mounts_to_reread(devs, listings, orphans, {}, read_as) == {
        POD_MOUNT: {"psm_a"}
    }
    # Nothing written, nothing named by an event: nothing to read again.
    assert (
        mounts_to_reread(
            devs, listings, orphans, {}, {POD_MOUNT: {"psm_a": 8192, "psm_b": 4096}}
        )
        == {}
    )
    # An event named one: its pod is read again, with nothing written.
    unwritten = {POD_MOUNT: {"psm_a": 8192, "psm_b": 4096}}
    assert mounts_to_reread(
        devs, listings, orphans, {POD_MOUNT: {"psm_b"}}, unwritten
    ) == {POD_MOUNT: set()}
    # An orphan never read before (no bytes then) counts as written.
    assert mounts_to_reread(devs, listings, {POD_MOUNT: {"psm_new"}}, {}, {}) == {
        POD_MOUNT: {"psm_new"}
    }


def test_an_orphan_written_in_no_pods_mount_asks_for_a_full_scan() -> None:
    devs = {POD_MOUNT: 40, HOST_MOUNT: 41}
    listings: Listings = {
        POD_MOUNT: listing(psm_a=4096),
        HOST_MOUNT: listing(nccl_x=8192),
    }
    orphans = {HOST_MOUNT: {"nccl_x"}}
    assert (
        mounts_to_reread(devs, listings, orphans, {}, {HOST_MOUNT: {"nccl_x": 4096}})
        is None
    )
    assert (
        mounts_to_reread(
            devs, listings, orphans, {HOST_MOUNT: None}, {HOST_MOUNT: {"nccl_x": 8192}}
        )
        is None
    )
    # Unwritten and unnamed, the host's mount asks for nothing.
    assert (
        mounts_to_reread(devs, listings, orphans, {}, {HOST_MOUNT: {"nccl_x": 8192}})
        == {}
    )


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def calm_scan(pace: ScanPace, mounts: Tuple[str, ...], owners: Owners) -> None:
    pace.look(mounts)
    pace.scanned(mounts, owners, quiet=True, stretch=True)


def test_the_full_scan_is_due_at_once_then_after_its_interval() -> None:
    clock = Clock()
    pace = ScanPace(120.0, 8, clock)
    pace.look(("m",))  # what a first full run does before its scan
    assert pace.due() and pace.every == 120.0
    pace.scanned(("m",), Owners(), quiet=True, stretch=True)
    assert (
        pace.scanned_at == 1000.0 and pace.every == 120.0
    )  # the first scan: nothing to compare
    clock.now += 119.9
    assert not pace.due()
    clock.now += 0.1
    assert pace.due()


def test_the_interval_doubles_while_nothing_changes_up_to_its_cap_and_is_back_on_a_change() -> (
    None
):
    pace = ScanPace(10.0, 4, Clock())
    owners = Owners(holders={}, holdings={})
    pace.scanned(("m",), owners, quiet=True, stretch=True)
    everies = []
    for _ in range(4):
        calm_scan(pace, ("m",), owners)
        everies.append(pace.every)
    assert everies == [20.0, 40.0, 40.0, 40.0]
    pace.changed()
    assert pace.every == 10.0
    calm_scan(pace, ("m",), owners)  # the scan after a change: not calm yet
    assert pace.every == 10.0
    calm_scan(pace, ("m",), owners)
    assert pace.every == 20.0


@pytest.mark.parametrize("quiet, stretch", [(False, True), (True, False)])
def test_a_scan_that_saw_a_change_or_may_miss_one_keeps_the_base(
    quiet: bool, stretch: bool
) -> None:
    pace = ScanPace(10.0, 8, Clock())
    owners = Owners()
    pace.scanned(("m",), owners, quiet=True, stretch=True)
    calm_scan(pace, ("m",), owners)
    assert pace.every == 20.0
    pace.scanned(("m",), owners, quiet=quiet, stretch=stretch)
    assert pace.every == 10.0


def test_new_mounts_or_other_holders_bring_the_base_back() -> None:
    pace = ScanPace(10.0, 8, Clock())
    owners = Owners(holders={}, holdings={})
    pace.scanned(("m",), owners, quiet=True, stretch=True)
    calm_scan(pace, ("m",), owners)
    assert pace.every == 20.0
    pace.look(("m", "n"))  # a mount came
    assert pace.every == 10.0
    calm_scan(pace, ("m", "n"), owners)
    calm_scan(pace, ("m", "n"), owners)
    assert pace.every == 20.0
    pace.look(("m", "n"), Owners(holders={}, holdings={}))  # a refresh found the same
    assert pace.every == 20.0
    held = Owners(holders={}, holdings={(1, 2): []})
    pace.look(("m", "n"), held)  # a refresh found a new holding
    assert pace.every == 10.0
    calm_scan(pace, ("m", "n"), owners)
    assert pace.every == 10.0  # it changed since: not calm
    pace.scanned(("m", "n"), held, quiet=True, stretch=True)
    calm_scan(pace, ("m", "n"), held)
    assert pace.every == 20.0


def test_why_segments_are_unverified_is_logged_when_it_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="t41")
    said = UnprovenLog(logging.getLogger("t41"))
    unread = Owners(
        unproven=["python3 (pid 7, uid 1000)", "2 process(es) hidden by hidepid"]
    )
    said.say(unread)
    assert [r.getMessage() for r in caplog.records] == [
        "segments held by no readable process are 'unverified', not 'orphan': could not read "
        "python3 (pid 7, uid 1000); 2 process(es) hidden by hidepid (--segments.ignore-unreadable "
        "excuses root's processes by name)"
    ]
    assert caplog.records[0].levelno == logging.INFO
    caplog.clear()
    said.say(
        Owners(
            unproven=["2 process(es) hidden by hidepid", "python3 (pid 9, uid 1000)"]
        )
    )
    assert caplog.records == []  # the same reasons, other pids and counts: said already
    said.say(Owners(unproven=["vllm (pid 9, uid 1000)"]))
    assert (
        len(caplog.records) == 1
        and "could not read vllm (pid 9, uid 1000) (" in caplog.records[0].getMessage()
    )
    caplog.clear()
    said.say(Owners())
    assert [r.getMessage() for r in caplog.records] == [
        "every process could be read: segments held by nobody are orphans again"
    ]
    caplog.clear()
    said.say(Owners())
    assert caplog.records == []


def test_only_the_first_reasons_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="t41.bounded")
    unproven = [f"p{i} (pid {i}, uid 1)" for i in range(MAX_UNPROVEN + 3)]
    UnprovenLog(logging.getLogger("t41.bounded")).say(Owners(unproven=unproven))
    text = caplog.records[0].getMessage()
    assert f"p{MAX_UNPROVEN - 1} (pid" in text and f"p{MAX_UNPROVEN} (pid" not in text


# --- segment states (DESIGN.md "Segment states") -----------------------------------------------
def test_segment_states():
    """(known at the last full scan, held at it, every process inspected, quick run, owners
    from a full scan this run) -> the state of a listed file nobody holds (a held one is
    linked without asking). Leaked only on a full scan's word."""
    dev, ino = 40, 7
    cases = {
        (True, False, True, False, True): "orphan",  # known, unheld, a full scan saw it
        (True, False, False, False, True): "unverified",  # somebody could not be inspected
        (True, True, True, False, False): "unverified",  # held at the full scan: only it may say
        (True, True, True, True, False): "unverified",
        (True, False, True, True, False): "orphan",  # a quick run: the full scan's owners hold
        (True, True, True, False, True): "orphan",  # the full scan itself found it unheld
        (False, False, True, True, False): "linked",  # new since the full scan: its creator's
        (False, False, False, True, False): "linked",
        (False, False, True, False, True): "orphan",  # new, and the full scan found nobody
        (False, False, False, False, True): "unverified",
        (False, False, True, False, False): "unverified",  # a refresh found nobody: not leaked yet
        (False, True, True, False, False): "unverified",
    }
    for (known, at_full, complete, quick, settled), state in cases.items():
        row = Row.pack(class_index=0, inode=ino, mtime=0, blocks=8, apparent_bytes=4096, known=known)
        held_at_full = {(dev, ino)} if at_full else set()
        got = unheld_state("a", row, (dev, ino), dev, (), held_at_full, complete, quick, settled)
        assert got == state, (known, at_full, complete, quick, settled)


def test_a_doubted_or_once_held_file_is_leaked_only_on_a_full_scans_word():
    """Changed since its pod was read (`doubted`: those names, or None for any), or held at
    the last full scan: unverified until a full scan; otherwise a known unheld file is an
    orphan. The held set is keyed by (device, inode): the same inode on another device is
    another file."""
    def state(name, doubted=(), held=frozenset(), settled=False, complete=True):
        return unheld_state(name, KNOWN_ROW, KEY, DEV, doubted, held, complete, False, settled)

    assert state("a") == "orphan"
    assert state("a", doubted=None) == "unverified"
    assert state("a", doubted={"a"}) == "unverified"
    assert state("b", doubted={"a"}) == "orphan"
    assert state("a", held={KEY}) == "unverified"
    assert state("a", held={(DEV + 1, INO), (DEV, INO + 1)}) == "orphan"
    for doubted, held in ((None, set()), ({"a"}, set()), ((), {KEY})):
        assert state("a", doubted, held, settled=True) == "orphan"
        assert state("a", doubted, held, settled=True, complete=False) == "unverified"
    assert state("a", complete=False) == "unverified"
