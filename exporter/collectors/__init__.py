"""Sources: one module each, returning one model type (model/types.py), never metric
objects; each implements `source.Source` whole and registers once (`source.register`)."""

from exporter.collectors.source import Context, Source, registered

# Each module registers itself on import, in this order (the order their series are rendered).
from exporter.collectors import (  # noqa: E402, F401
    shm_mount,
    segments,
    sysv,
    host_memory,
    cgroup,
    gpu,
    oom,
    self_process,
)

__all__ = ["Context", "Source", "registered"]
