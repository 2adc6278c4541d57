"""A restart of shmwatch: what a fresh exporter says of the segments already there, and what
it counts. A leak from before the restart is `orphan` from the fresh exporter's first answer
(its first run reads every process), with its age from the file, not from the restart; a live
segment is `linked`; no file that was there before is counted as created, and a create or a
delete after it is counted once. With inotify, and polling (--no-inotify: the events come from
the listings' differences). Real exporters one after the other on a real tmpfs, real holders
and real files left by processes that exited."""

import os
import time
from typing import Dict

import pytest

from tests.conftest import EVERY_FAMILY, Exporter, Peer, Samples, needs_root, select, value

pytestmark = needs_root

MiB = 1 << 20
HOUR = 3600
# The events are an opt-in family.
ARGS = ("--no-collector.gpu", "--no-collector.cgroup", "--inventory-interval=300ms", EVERY_FAMILY)


def aged(mount: str, name: str, seconds: float = 60.0) -> None:
    """Last written `seconds` ago: a segment that old is named (shmwatch_top_segment_bytes)."""
    then = time.time() - seconds
    os.utime(os.path.join(mount, name), (then, then))


def leave(mount: str, name: str) -> None:
    """A file left by a process that exited, a minute after it was written."""
    with Peer(mount, "left", name, str(MiB)) as peer:
        peer.proc.wait(10)
    aged(mount, name)


def states(samples: Samples, mount: str) -> Dict[str, str]:
    """name -> state of the named segments (every one here: older than a minute, fewer than
    --segments.top-k)."""
    found = select(samples, "shmwatch_top_segment_bytes", mount=mount)
    return {labels["name"]: labels["state"] for labels, _ in found}


def events(samples: Samples, mount: str) -> Dict[str, float]:
    """'class/event' -> count, of those counted at all."""
    found = select(samples, "shmwatch_segment_events_total", mount=mount)
    return {f"{labels['class']}/{labels['event']}": v for labels, v in found if v}


@pytest.mark.parametrize("watch", ["inotify", "polling"])
def test_a_restarted_exporter_calls_old_leaks_leaked_at_once_and_counts_nothing_twice(
    tmpfs: str, watch: str
) -> None:
    args = (*ARGS, f"--shm.mount={tmpfs}") + (
        ("--no-inotify",) if watch == "polling" else ()
    )
    leave(tmpfs, "nccl-before001")
    aged(tmpfs, "nccl-before001", HOUR)
    with Peer(tmpfs, "mapped", "psm_live0001", str(MiB)):
        aged(tmpfs, "psm_live0001")
        with Exporter(*args) as first:
            s = first.scrape()
            assert states(s, tmpfs) == {
                "nccl-before001": "orphan",
                "psm_live0001": "linked",
            }
            assert (
                events(s, tmpfs) == {}
            )  # there before it started: not created under its eyes
            leave(tmpfs, "nccl-during01")
            first.wait_for(
                lambda s: states(s, tmpfs).get("nccl-during01") == "orphan", timeout=10
            )
            assert events(first.scrape(), tmpfs) == {"nccl/created": 1}
        # The restart: a new process, nothing carried over but the files themselves.
        with Exporter(*args) as second:
            s = second.scrape()
            want = {
                "nccl-before001": "orphan",
                "nccl-during01": "orphan",
                "psm_live0001": "linked",
            }
            assert states(s, tmpfs) == want
            age = value(s, "shmwatch_orphan_oldest_age_seconds", mount=tmpfs)
            assert age is not None
            assert HOUR <= age < HOUR + 300  # the file's, not the restart's
            assert events(s, tmpfs) == {}
            leave(tmpfs, "nccl-after001")
            os.unlink(os.path.join(tmpfs, "nccl-before001"))
            s = second.wait_for(
                lambda s: (
                    "nccl-before001" not in states(s, tmpfs)
                    and states(s, tmpfs).get("nccl-after001") == "orphan"
                ),
                timeout=10,
            )
            time.sleep(0.7)  # two more polls: a difference counted once only
            assert events(second.scrape(), tmpfs) == {
                "nccl/created": 1,
                "nccl/deleted": 1,
            }
