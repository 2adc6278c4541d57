"""Sources: one module each, returning a model type (model/types.py), never metrics."""

from exporter.collectors.source import REGISTRY, Context, Source

# Each module registers itself on import, in this order (the order their series are rendered).
from exporter.collectors import shm_mount, segments, sysv, host_memory  # noqa: F401
from exporter.collectors import cgroup, gpu, oom, self_process  # noqa: F401

__all__ = ["REGISTRY", "Context", "Source"]
