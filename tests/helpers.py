"""Run sources once against a tree and read the values back from a fresh registry."""
from dataclasses import dataclass

from prometheus_client.registry import CollectorRegistry

from exporter.collectors.discovery import MountDiscovery
from exporter.exposition.metrics import ModelCollector
from exporter.model.step import ModelStep
from exporter.host.paths import Paths
from exporter.runtime.scheduler import Sampler
from exporter.model.state import StateStore


@dataclass
class Harness:
    sampler: Sampler
    state: StateStore
    step: ModelStep


def run_every_source_once(sampler: Sampler) -> None:
    """Each source's full run, in this thread, published as the scheduler would."""
    for runner in sampler.runners.values():
        runner.run_once(full=True)


def registry_for(*sources, shm_size_limit=None, memory_limit=None, mounts=None):
    """The serve path without threads: sampler -> model step -> ModelCollector. The mounts
    are the first source's that has any (or `mounts`)."""
    if mounts is None:
        mounts = next((s.mounts() for s in sources if s.name in ("shm_mount", "segments")), [])
    discovery = MountDiscovery(Paths(), mounts)
    state = StateStore()
    sampler = Sampler(list(sources))
    step = ModelStep(sources, discovery, state, shm_size_limit=shm_size_limit, memory_limit=memory_limit)
    sampler.subscribe(step.accept)
    run_every_source_once(sampler)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ModelCollector(step))
    return registry, Harness(sampler, state, step)
