"""Sources: one module per source, each returning one model type (model/types.py) in every
mode, never metric objects.

Every source implements `source.Source` whole and registers once, at the bottom of its
module (`source.register`). The scheduler runs sources; the model step joins what they return.
"""

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
