"""Run collectors once against a tree and read the values back from a fresh registry."""
from prometheus_client.registry import CollectorRegistry

from exporter.metrics import SnapshotCollector
from exporter.sampler import Sampler


def registry_for(*collectors, shm_size_limit=None, sampler_hook=None):
    sampler = Sampler(list(collectors))
    if sampler_hook:
        sampler_hook(sampler)
    sampler.run_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(sampler, shm_size_limit))
    return registry, sampler
