"""app.py: the wiring. Discovery is the first source and the collectors switched off are not
made; the step reports the sources that have status series (discovery in node mode only);
the subscribers are the watcher, the model step and the give-back, in that order; a file
made in a watched tmpfs reaches the model through the watcher's request and a quick run
(no poll); stop closes every source no run holds."""

import os
import time
from typing import Callable, List

from exporter.app import App
from exporter.collectors import REGISTRY
from exporter.config import parse_args
from exporter.model.step import Model
from tests.conftest import fallocate, needs_root

MIB = 1 << 20


def app(*flags: str) -> App:
    return App(parse_args(["--no-collector.gpu", "--log.level=error", *flags]))


def test_discovery_runs_first_and_switched_off_collectors_are_not_made(tmp_path: str) -> None:
    made = app(f"--shm.mount={tmp_path}", "--no-collector.sysv")
    names = [s.name for s in made.sources]
    assert names[0] == "discovery" and made.sources[0] is made.discovery
    assert "gpu" not in names and "sysv" not in names
    assert names[1:] == [n for n in REGISTRY if n in names[1:]]  # the registry's order
    assert {"shm_mount", "segments"} <= set(names)


def test_the_model_reports_the_sources_with_status_series(tmp_path: str) -> None:
    sidecar = app(f"--shm.mount={tmp_path}").step.current().statuses
    assert "discovery" not in [s.name for s in sidecar] and "shm_mount" in [s.name for s in sidecar]
    node = app("--mode=node", f"--path.rootfs={tmp_path}").step.current().statuses
    assert [s.name for s in node][0] == "discovery"


def test_node_mode_drops_the_one_workloads_memory_limit(tmp_path: str) -> None:
    assert app("--mode=node", f"--path.rootfs={tmp_path}", "--memory.limit-bytes=1Mi").step.memory_limit is None


def test_the_subscribers_are_the_watcher_the_step_and_the_give_back_in_that_order(tmp_path: str) -> None:
    """The watcher drops its polled mounts' events before the step builds on the
    observation; the give-back, last, finds the step's inventory before freed."""
    made = app(f"--shm.mount={tmp_path}")
    assert made.sampler._subscribers == [made.watcher.on_observation, made.step.accept,
                                         made.give_back.on_observation]


def wait_for(step_model: Callable[[], Model], ok: Callable[[Model], bool], timeout: float = 10.0) -> Model:
    deadline = time.monotonic() + timeout
    while True:
        model = step_model()
        if ok(model) or time.monotonic() > deadline:
            return model
        time.sleep(0.05)


def used(model: Model) -> int:
    usage = model.mounts[0].usage if model.mounts else None
    return usage.used_bytes if usage else -1


@needs_root
def test_a_file_made_in_a_watched_mount_reaches_the_model_without_a_poll(tmpfs: str) -> None:
    """One way through: inotify -> the watcher -> the scheduler -> a quick run -> the step.
    The poll is an hour away."""
    made = app(f"--shm.mount={tmpfs}", "--poll-interval=1h", "--inventory-interval=1h")
    made.start()
    try:
        assert made.sampler.wait_for_first_run(20.0)
        assert used(made.step.current()) == 0
        fallocate(os.path.join(tmpfs, "psm_shm.x"), 2 * MIB)
        model = wait_for(made.step.current, lambda m: used(m) == 2 * MIB)
        assert used(model) == 2 * MIB
        rows = wait_for(made.step.current, lambda m: bool(m.mounts[0].inventory and m.mounts[0].inventory.files))
        inventory = rows.mounts[0].inventory
        assert inventory is not None and [s.name for s in inventory.rows()] == ["psm_shm.x"]
    finally:
        made.stop()


def test_stop_closes_every_source(tmp_path: str) -> None:
    made = app(f"--shm.mount={tmp_path}", "--poll-interval=1h", "--inventory-interval=1h")
    closed: List[str] = []
    for source in made.sources:
        source.close = (lambda name: lambda: closed.append(name))(source.name)  # type: ignore[method-assign]
    made.start(watch=False)
    assert made.sampler.wait_for_first_run(20.0)
    made.stop()
    assert sorted(closed) == sorted(s.name for s in made.sources)
