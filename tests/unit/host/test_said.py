"""host/said.py: a lasting condition logged when it begins, changes or ends; what is kept
follows the keys each run names, so a key gone (a deleted pod's mount) is forgotten."""

import logging
from typing import List, Tuple

from exporter.host.said import SaidOnce


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def said() -> Tuple[SaidOnce, Lines]:
    log = logging.getLogger(f"test_said.{id(object())}")
    log.propagate, log.level = False, logging.DEBUG
    lines = Lines()
    log.addHandler(lines)
    return SaidOnce(log), lines


def test_a_condition_is_said_when_it_begins_changes_and_ends() -> None:
    once, lines = said()
    for message in ("full", "full", "fuller", None, None, "full"):
        once.run(["/m"]).say("/m", message, back="fine again")
    assert lines.lines == ["WARNING mount /m: full", "WARNING mount /m: fuller", "INFO mount /m: fine again",
                           "WARNING mount /m: full"]


def test_a_key_a_run_leaves_out_is_forgotten_and_told_about_afresh_when_it_comes_back() -> None:
    # The bug: SaidOnce's callers had to call keep() themselves, and the segments collector
    # never did: a deleted pod's mount stayed said for good, and one back at the same path
    # was not warned about again.
    once, lines = said()
    once.run(["/pod-a", "/pod-b"]).say("/pod-a", "over the cap")
    once.run(["/pod-b"])  # pod a deleted
    once.run(["/pod-a", "/pod-b"]).say("/pod-a", "over the cap")  # and back at the same path
    assert lines.lines == ["WARNING mount /pod-a: over the cap"] * 2


def test_a_key_a_run_does_not_mention_keeps_what_was_said() -> None:
    # A quick run measures a few mounts: the others' conditions stand.
    once, lines = said()
    once.run(["/a", "/b"]).say("/a", "not tmpfs")
    once.run(["/a", "/b"]).say("/b", "not tmpfs")
    once.run(["/a", "/b"]).say("/a", "not tmpfs")
    assert lines.lines == ["WARNING mount /a: not tmpfs", "WARNING mount /b: not tmpfs"]


def test_what_is_kept_is_bounded_by_the_live_keys() -> None:
    # 10,000 short-lived pods, each warned about once: an ended run keeps none of them, so
    # every one that comes back is warned about again.
    once, lines = said()
    for i in range(10_000):
        once.run([f"/pod-{i}"]).say(f"/pod-{i}", "truncated")
    once.run([])
    for i in range(0, 10_000, 1000):
        once.run([f"/pod-{i}"]).say(f"/pod-{i}", "truncated")
    assert len(lines.lines) == 10_000 + 10
