"""collectors/source.py: what a run is handed (RunInput, frozen), what a source is when it
says only how to collect (the Protocol's defaults), and the one registration point: each
registered factory makes the source of its name from the process's Context."""

import dataclasses
from typing import List

import pytest

from exporter.collectors.source import REGISTRY, Context, Registration, RunInput, Source, register
from exporter.config import parse_args
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable


def test_a_run_input_is_frozen_and_touched_are_the_mounts_named() -> None:
    run = RunInput(mounts=("/a", "/b"), changes={"/a": frozenset({"x"}), "/b": None})
    assert set(run.touched) == {"/a", "/b"}
    assert RunInput().touched == set() and RunInput().mounts == ()
    assert not RunInput().all_watched and not RunInput().kill_log_complete  # unknown: no
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.mounts = ()  # type: ignore[misc]


class Counting(Source):
    name = "counting"

    def __init__(self) -> None:
        self.runs: List[RunInput] = []

    def collect(self, run: RunInput) -> object:
        self.runs.append(run)
        return len(self.runs)


def test_a_source_that_only_collects_takes_the_defaults() -> None:
    source = Counting()
    run = RunInput(mounts=("/m",))
    assert source.collect_quick(run) == 1 and source.runs == [run]  # a quick run is a full one
    assert source.begin_full(run) is None  # no stages: `collect` for full runs
    assert source.stretches(run) is False and source.close() is None
    assert (source.schedule, source.event_driven, source.follows_up) == ("poll", False, True)
    assert source.reports_status and not source.scans_beside_quick_runs


def test_register_keeps_the_order_and_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("exporter.collectors.source.REGISTRY", dict(REGISTRY))
    from exporter.collectors import source as module

    register("late", lambda c: Counting())
    register("node_only", lambda c: Counting(), modes=("node",), flag=False)
    assert list(module.REGISTRY)[-2:] == ["late", "node_only"]
    assert module.REGISTRY["late"].modes == ("sidecar", "node") and module.REGISTRY["late"].flag
    assert module.REGISTRY["node_only"] == Registration(
        name="node_only", factory=module.REGISTRY["node_only"].factory, modes=("node",), flag=False
    )
    assert "late" not in REGISTRY  # the module's own registry untouched


@pytest.mark.parametrize("mode", ["sidecar", "node"])
def test_each_registered_factory_makes_the_source_of_its_name(mode: str) -> None:
    cfg = parse_args([f"--mode={mode}", "--no-collector.gpu"])
    paths = Paths()
    context = Context(cfg=cfg, paths=paths, table=ProcessTable(paths))
    assert context.node == (mode == "node")
    made = []
    for name, registration in REGISTRY.items():
        source = registration.factory(context)
        made.append(source)
        assert source.name == name
    for source in made:
        source.close()


def test_a_failing_subscriber_does_not_stop_a_source():
    """An exception in one subscriber (a bug in the watcher, say) must not end the source's
    thread, nor keep the other subscribers from the observation."""
    from exporter.collectors.source import Source
    from exporter.runtime.scheduler import Sampler

    class Counter(Source):
        name = "counter"
        runs = 0

        def collect(self, run):
            Counter.runs += 1
            return Counter.runs

    seen = []
    sampler = Sampler([Counter()], poll_interval=0.05)

    def broken(obs):
        raise RuntimeError("subscriber bug")

    sampler.subscribe(broken)
    sampler.subscribe(seen.append)
    sampler.start()
    try:
        import time
        deadline = time.monotonic() + 5
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        sampler.stop()
    assert len(seen) >= 3 and all(o.success for o in seen)


def test_segments_stretch_only_in_node_mode_while_inotify_watches_every_mount():
    """A polled mount changes unseen: its full runs keep to the interval."""
    from exporter.collectors.segments import SegmentsCollector
    from exporter.host.paths import Paths

    node = SegmentsCollector(Paths(), pod_of_pid=True)
    assert not node.stretches(RunInput(all_watched=False))
    assert node.stretches(RunInput(all_watched=True))
    assert not SegmentsCollector(Paths()).stretches(RunInput(all_watched=True))
