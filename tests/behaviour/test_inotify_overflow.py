"""Lost inotify events are answered by a full inventory, one that reads /proc, so the leaks
made while the events were lost are called leaked at once; events that arrive are answered
by a quick run, which reads no process and so never calls a new file leaked (its creator
may not have mapped it yet), and a full run follows it.

A sidecar's segments source, wired as app.py wires it (the watcher tells the scheduler what
changed, the scheduler hands it to the runs), on a real tmpfs; the storm is a real process that makes 200 files and
exits. watchdog's reader starts only once the storm is over, as one that falls behind would:
the kernel keeps what its queue holds (fs.inotify.max_queued_events) and drops the rest for
one IN_Q_OVERFLOW. With a queue of 0 it keeps nothing but the overflow, so the run that
answers is the overflow's alone; with the default queue every event arrives."""

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, List, Optional, Set, Tuple

from watchdog.observers.inotify_c import InotifyFD

from exporter.collectors.segments import SegmentsCollector
from exporter.host.paths import Paths
from exporter.model.state import StateStore
from exporter.model.types import Inventory, Observation
from exporter.runtime.scheduler import Sampler
from exporter.runtime.watcher import MountWatcher
from tests.conftest import HOST_EXCUSED_RE, needs_root

pytestmark = needs_root

STORM = 200
QUEUE_KNOB = "/proc/sys/fs/inotify/max_queued_events"
STORM_SCRIPT = r"""
import os, sys
for i in range(int(sys.argv[2])):
    os.close(os.open(os.path.join(sys.argv[1], f"psm_storm{i:04d}"), os.O_CREAT | os.O_WRONLY, 0o600))
"""


class LateReader(InotifyFD):
    """watchdog's inotify reader, whose thread starts once `go` is set: the kernel queues the
    events meanwhile and drops those past the queue's size (IN_Q_OVERFLOW). Made with a
    queue of `queue` events (the knob is read at inotify_init, and put back at once)."""

    def __init__(self, go: threading.Event, queue: Optional[int]) -> None:
        with open(QUEUE_KNOB) as f:
            saved = f.read().strip()
        try:
            if queue is not None:
                with open(QUEUE_KNOB, "w") as f:
                    f.write(str(queue))
            super().__init__()
        finally:
            with open(QUEUE_KNOB, "w") as f:
                f.write(saved)
        self.go = go

    def start(self) -> None:
        threading.Thread(target=self._start_on_go, daemon=True).start()

    def _start_on_go(self) -> None:
        self.go.wait()
        InotifyFD.start(self)


@contextmanager
def watched_inventory(
    mount: str, queue: Optional[int]
) -> Iterator[Tuple[List[Observation], StateStore, threading.Event]]:
    """(the segments observations published, the state the watcher feeds, the gate of the
    reader) for `mount`, once the first full run is published. Runs come from events only:
    the inventory interval is 60 s."""
    source = SegmentsCollector(Paths(), ignore_unreadable=HOST_EXCUSED_RE)
    sampler = Sampler([source], inventory_interval=60.0, mounts=[mount])
    published: List[Observation] = []
    sampler.subscribe(published.append)
    state, go = StateStore(), threading.Event()
    watcher = MountWatcher(
        state,
        Paths(),
        sampler,
        inotify_factory=lambda: LateReader(go, queue),
    )
    sampler.subscribe(watcher.on_observation)
    sampler.start()
    try:
        assert sampler.wait_for_first_run(20)
        watcher.refresh([mount])
        yield published, state, go
    finally:
        watcher.stop()
        sampler.stop()


def storm(mount: str) -> List[str]:
    """STORM files made by a process that exits: leaks nobody holds."""
    subprocess.run([sys.executable, "-c", STORM_SCRIPT, mount, str(STORM)], check=True)
    return [f"psm_storm{i:04d}" for i in range(STORM)]


def wait_for(
    published: List[Observation],
    holds: Callable[[Observation], bool],
    since: int = 0,
    timeout: float = 10.0,
) -> Observation:
    """The first observation published after the first `since` that `holds`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for obs in published[since:]:
            if obs.success and holds(obs):
                return obs
        time.sleep(0.02)
    runs = [(o.full, o.error) for o in published[since:]]
    raise AssertionError(f"not within {timeout} s: {runs}")


def states_of(obs: Observation, names: List[str]) -> Set[Optional[str]]:
    inventory = obs.result
    assert isinstance(inventory, Inventory)
    rows = {s.name: s.state for s in inventory.mounts[0].rows()}
    return {rows.get(name) for name in names}


def after(
    published: List[Observation], seen: int, names: List[str]
) -> List[Tuple[bool, Set[Optional[str]]]]:
    """(full run?, the states of `names`) of each observation published after the first `seen`."""
    return [(o.full, states_of(o, names)) for o in published[seen:] if o.success]


def test_lost_events_bring_a_full_inventory_that_calls_the_storms_leaks_leaked(
    tmpfs: str,
) -> None:
    with watched_inventory(tmpfs, queue=0) as (published, state, go):
        names, seen = storm(tmpfs), len(published)
        go.set()
        wait_for(published, lambda o: True, since=seen)
        assert state.snapshot().overflows == {tmpfs: 1}  # the events were lost indeed
        # The first run after the overflow read /proc: the exited creator's files are leaked.
        assert after(published, seen, names)[0] == (True, {"orphan"})


def test_events_that_arrive_are_answered_by_a_quick_run_then_a_full_one(
    tmpfs: str,
) -> None:
    with watched_inventory(tmpfs, queue=None) as (published, state, go):
        names, seen = storm(tmpfs), len(published)
        go.set()
        wait_for(published, lambda o: o.full and states_of(o, names) == {"orphan"})
        assert state.snapshot().overflows == {}
        answers = after(published, seen, names)
        # Quick runs first (the events name the files): none calls a new file leaked.
        quick = answers[: next(i for i, (full, _) in enumerate(answers) if full)]
        assert quick and all(states <= {"linked", None} for _, states in quick), answers
