"""model/summary.py: which segments a series may name, and which the exporter names.

A segment's name is a label only while it is bounded and worth acting on: a leak (an orphan
of a class that leaks) last modified ORPHAN_NAMED_AFTER_SECONDS ago, any other segment
NAMED_AFTER_SECONDS ago, --segments.top-k of them on the exporter (not per mount), leaks first.
"""

from exporter.model.summary import (NAMED_AFTER_SECONDS, ORPHAN_NAMED_AFTER_SECONDS, named_first, named_now,
                                    named_on_exporter, owner_comm, summarise)
from exporter.model.types import Segment
from tests.test_decisions import inventory

MiB = 1 << 20
NOW = 1_000_000.0


def seg(name, cls="python_shm", state="linked", size=MiB, age=3600.0, holders=()):
    """A segment last modified `age` seconds before NOW (None: time not known)."""
    mtime = 0.0 if age is None else NOW - age
    return Segment(name, cls, state, size, size, mtime, holders)


def test_a_segment_is_named_once_old_enough_a_leak_sooner():
    assert named_now(seg("a", age=NAMED_AFTER_SECONDS), NOW)
    assert not named_now(seg("a", age=NAMED_AFTER_SECONDS - 1), NOW)
    assert named_now(seg("o", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS), NOW)
    assert not named_now(seg("o", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS - 1), NOW)
    for state in ("hidden", "unverified"):  # only an orphan is named sooner
        assert not named_now(seg("x", state=state, age=ORPHAN_NAMED_AFTER_SECONDS), NOW), state
    # A time not known (an unlinked segment only mapped) is not "old": never named.
    assert not named_now(seg("h", state="hidden", age=None), NOW)
    assert not named_now(seg("o", state="orphan", age=None), NOW)
    assert ORPHAN_NAMED_AFTER_SECONDS < NAMED_AFTER_SECONDS


def test_leaks_come_first_then_the_largest():
    leak = seg("psm_small", state="orphan", size=1)
    semaphore = seg("sem.x", cls="semaphore", state="orphan", size=2 * MiB)  # not a leak
    big = seg("nccl-big", cls="nccl", size=3 * MiB)
    same_size = seg("a", size=3 * MiB)
    assert sorted([big, semaphore, same_size, leak], key=named_first) == [leak, same_size, big, semaphore]


def test_the_summary_keeps_the_segments_to_name():
    """Young segments are counted, never named; with no `now` every segment may be."""
    inv = inventory("/m", [
        seg("psm_young_leak", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS - 5, size=9 * MiB),
        seg("psm_old_leak", state="orphan", age=ORPHAN_NAMED_AFTER_SECONDS + 5),
        seg("nccl-young", cls="nccl", age=NAMED_AFTER_SECONDS - 5, size=8 * MiB),
        seg("nccl-old", cls="nccl", age=NAMED_AFTER_SECONDS + 5, size=2 * MiB),
        seg("torch_tiny", cls="torch", age=7200, size=4096),
    ])
    s = summarise(inv, 2, now=NOW)
    assert [x.name for x in s.top] == ["psm_old_leak", "nccl-old"]
    assert [x.name for x in summarise(inv, 5, now=NOW).top] == ["psm_old_leak", "nccl-old", "torch_tiny"]
    assert s.totals[("python_shm", "orphan")].count == 2 and s.totals[("nccl", "linked")].count == 2  # all counted
    assert [x.name for x in s.leaked] == ["psm_young_leak", "psm_old_leak"]  # check names every leak
    assert [x.name for x in summarise(inv, 2).top] == ["psm_young_leak", "psm_old_leak"]


def test_the_exporter_names_top_k_across_its_mounts():
    """Not K a mount: 200 pods' long-lived segments give K series, and a leak on any mount
    comes before a larger segment on another."""
    mounts = [(f"pod{i}", summarise(inventory(f"/m{i}", [
        seg(f"psm_{i}_a", size=(i + 1) * MiB), seg(f"psm_{i}_b", size=(i + 1) * MiB + 512)]), 10, now=NOW))
        for i in range(200)]
    leak = summarise(inventory("/leaky", [seg("nccl-left", cls="nccl", state="orphan", size=1)]), 10, now=NOW)
    chosen = named_on_exporter(mounts + [("leaky", leak)], 3)
    assert [(key, s.name) for key, s in chosen] == [("leaky", "nccl-left"), ("pod199", "psm_199_b"),
                                                    ("pod199", "psm_199_a")]
    assert named_on_exporter(mounts, 0) == []
    assert len(named_on_exporter(mounts, 10)) == 10


def test_an_owner_is_a_process_name_not_a_pid():
    assert owner_comm((), {}) == ""
    assert owner_comm((7, 8), {7: "vllm", 8: "python3"}) == "vllm"
    assert owner_comm((9,), {}) == "unknown"
