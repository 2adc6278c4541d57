"""collectors/source.py: what a run is handed (RunInput, frozen), what a source is when it
says only how to collect (the Protocol's defaults), and the one registration point: each
registered factory makes the source of its name from the process's Context."""

import dataclasses
from typing import List

import pytest

from exporter.collectors.source import REGISTRY, Context, Registration, RunInput, Source
from exporter.collectors.source import register
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
