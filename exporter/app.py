"""Wires configuration to collectors, sampler, watcher and registry (serve and check share it)."""
from __future__ import annotations

from typing import List, Optional

from prometheus_client.registry import CollectorRegistry

from .collectors.cgroup import CgroupCollector
from .collectors.gpu import GpuCollector
from .collectors.host_memory import HostMemoryCollector
from .collectors.segments import SegmentsCollector
from .collectors.self_process import SelfProcessCollector
from .collectors.shm_mount import ShmMountCollector
from .collectors.sysv import SysvCollector
from .config import Config
from .discovery import MountDiscovery
from .events import MountWatcher
from .metrics import SnapshotCollector
from .paths import Paths
from .sampler import Sampler


def build_collectors(cfg: Config, paths: Paths, discovery: Optional[MountDiscovery] = None) -> List[object]:
    node = cfg.mode == "node"
    discovery = discovery or MountDiscovery(paths, cfg.shm_mounts, node_mode=node)
    makers = {
        "shm_mount": lambda: ShmMountCollector(paths, cfg.shm_mounts, discovery=discovery if node else None),
        "segments": lambda: SegmentsCollector(paths, discovery.mounts if node else cfg.shm_mounts, pod_of_pid=node,
                                              top_k=cfg.top_k),
        "sysv": lambda: SysvCollector(paths),
        "host_memory": lambda: HostMemoryCollector(paths),
        "cgroup": lambda: CgroupCollector(paths, cfg.cgroup_path, cfg.cgroup_target_process,
                                          cfg.memory_limit_bytes, node_mode=node),
        "gpu": lambda: GpuCollector(paths),
    }
    return [make() for name, make in makers.items() if cfg.collectors.get(name, True)]


class App:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
        self.discovery = MountDiscovery(self.paths, cfg.shm_mounts, node_mode=cfg.mode == "node")
        self.discovery.refresh()
        # The exporter's own process_* metrics are always on, read on the poll like the rest.
        self.collectors = build_collectors(cfg, self.paths, self.discovery) + [SelfProcessCollector()]
        self.sampler = Sampler(self.collectors, cfg.poll_interval, cfg.inventory_interval, cfg.peak_window,
                               timeouts={"gpu": cfg.gpu_timeout}, default_timeout=cfg.collector_timeout)
        segments = next((c for c in self.collectors if isinstance(c, SegmentsCollector)), None)
        self.watcher = MountWatcher(self.sampler, self.paths, self.discovery.mounts, enabled=cfg.inotify,
                                    changes=segments.changes if segments else None)
        self.sampler.listeners.append(self.watcher.on_result)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SnapshotCollector(self.sampler, cfg.shm_size_limit, cfg.memory_limit_bytes,
                                                 self.discovery))

    def start(self) -> None:
        self.watcher.start()
        self.sampler.start()

    def stop(self) -> None:
        self.watcher.stop()
        self.sampler.stop()
        for collector in self.collectors:
            close = getattr(collector, "close", None)
            if close is not None:
                close()
