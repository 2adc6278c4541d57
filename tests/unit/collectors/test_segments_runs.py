"""collectors/segments.py across runs: what a run published stays as it was published while
later runs change the listing, and a lasting condition of a mount (its walk cut short, past
the cap) is logged when it begins again after it ended, or after its mount went and came
back (node mode's pods come and go at the same paths)."""

import logging
import os
from typing import List, Tuple

import pytest

from exporter.collectors.segments import DEGRADED, TRUNCATED, SegmentsCollector
from exporter.host.paths import Paths
from exporter.inventory import walk as walk_module
from exporter.model.types import Inventory
from tests.conftest import HOST_EXCUSED_RE, fallocate, needs_root
from tests.helpers import Runs

pytestmark = needs_root


def rows(inv: Inventory) -> List[Tuple[str, str, str, int, int]]:
    return sorted((s.name, s.cls, s.state, s.allocated_bytes, s.key[1]) for m in inv.mounts for s in m.rows())


def runs(tmpfs: str, **options: object) -> Runs:
    return Runs(SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE, **options), [tmpfs])


def test_an_inventory_is_as_published_after_later_runs_change_the_listing(tmpfs: str) -> None:
    """The inventory a run published is read off its thread (a scrape's model, `check`): the
    next runs list, patch and mark rows, and none of it shows in it. (The listing's dict was
    published: the next walk dropped a deleted file's row under the states made for it.)"""
    collector = runs(tmpfs)
    for name in ("psm_a", "nccl-b", "torch_c"):
        fallocate(os.path.join(tmpfs, name), 4096)
    first = collector.full()
    published = rows(first)
    assert [r[0] for r in published] == ["nccl-b", "psm_a", "torch_c"]
    os.unlink(os.path.join(tmpfs, "nccl-b"))
    fallocate(os.path.join(tmpfs, "psm_d"), 8192)
    fallocate(os.path.join(tmpfs, "psm_a"), 3 * 4096)  # grown
    second = collector.full()
    assert [r[0] for r in rows(second)] == ["psm_a", "psm_d", "torch_c"]
    collector.changed(tmpfs, "psm_e")
    fallocate(os.path.join(tmpfs, "psm_e"), 4096)
    collector.quick()
    assert rows(first) == published
    assert first.mounts[0].files == 3 and len(first.mounts[0].names) == len(first.mounts[0].states)


def said(caplog: pytest.LogCaptureFixture, message: str) -> int:
    return sum(message in r.getMessage() for r in caplog.records)


def test_a_walk_cut_short_again_after_it_ended_is_logged_again(
    tmpfs: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A condition said when it begins, and again when it begins anew: said to have ended
    (None) when a walk reaches every entry. (It was never said to end: a mount cut short once
    was never warned about again.)"""
    caplog.set_level(logging.INFO, logger="exporter.collectors.segments")
    monkeypatch.setattr(walk_module, "MAX_ENTRIES", 30)
    collector = runs(tmpfs)
    fifos = [os.path.join(tmpfs, f"fifo{i}") for i in range(40)]
    for path in fifos:
        os.mkfifo(path)
    collector.full()
    collector.full()
    assert said(caplog, TRUNCATED) == 1
    for path in fifos:
        os.unlink(path)
    collector.full()
    for path in fifos:
        os.mkfifo(path)
    collector.full()
    assert said(caplog, TRUNCATED) == 2


def test_a_mount_past_the_cap_that_went_and_came_back_is_logged_again(
    tmpfs: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each run forgets what was said about the mounts it was not handed (a pod deleted): one
    back at the same path is told about afresh. (Kept for good: a node's deleted pods
    accumulated, and one back was never warned about.)"""
    caplog.set_level(logging.INFO, logger="exporter.collectors.segments")
    collector = runs(tmpfs, max_segments=2)
    for name in ("psm_a", "psm_b", "psm_c"):
        fallocate(os.path.join(tmpfs, name), 4096)
    past_the_cap = DEGRADED % 2
    collector.full()
    assert said(caplog, past_the_cap) == 1
    collector.mounts = []  # the pod deleted: its mount is no more
    collector.full()
    collector.mounts = [tmpfs]  # a pod at the same path
    collector.full()
    assert said(caplog, past_the_cap) == 2
