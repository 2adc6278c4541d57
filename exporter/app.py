"""Wires configuration to sources, sampler, model step, watcher and registry.

    discovery ─┐
    sources ───┴─▶ sampler ─▶ observations ─▶ model step ─▶ /metrics, shmwatch check
                                  │                ▲
    watcher (inotify) ─▶ state store (peaks, counters, inotify flags)

serve and check build the same thing; check runs every source once instead of starting
the threads.
"""

from __future__ import annotations

import re
from typing import List, Optional

from prometheus_client.registry import CollectorRegistry

from exporter.collectors.cgroup import CgroupCollector
from exporter.collectors.gpu import GpuCollector
from exporter.collectors.host_memory import HostMemoryCollector
from exporter.collectors.oom import OomCollector
from exporter.collectors.segments import SegmentsCollector
from exporter.collectors.self_process import SelfProcessCollector
from exporter.collectors.shm_mount import ShmMountCollector
from exporter.collectors.sysv import SysvCollector
from exporter.config import Config
from exporter.collectors.discovery import MountDiscovery
from exporter.runtime.watcher import MountWatcher
from exporter.exposition.render import Exposition
from exporter.inventory.changes import ChangeLog
from exporter.exposition.metrics import ModelCollector
from exporter.model.step import ModelStep
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.runtime.scheduler import Sampler
from exporter.model.state import StateStore


def build_sources(
    cfg: Config,
    paths: Paths,
    discovery: MountDiscovery,
    table: ProcessTable,
    changes: ChangeLog,
    kmsg_from_start: bool = False,
    state: Optional[StateStore] = None,
) -> List[object]:
    """Discovery first (the others read its mounts), then the collectors that are on."""
    node = cfg.mode == "node"
    makers = {
        "shm_mount": lambda: ShmMountCollector(
            paths,
            discovery.mounts,
            touched=state.drain_touched if state is not None else None,
        ),
        "segments": lambda: SegmentsCollector(
            paths,
            discovery.mounts,
            table,
            pod_of_pid=node,
            changes=changes,
            ignore_unreadable=re.compile(cfg.ignore_unreadable)
            if cfg.ignore_unreadable
            else None,
            full_scan_interval=cfg.full_scan_interval,
            watch_epoch=state.watch_epoch if state is not None else None,
        ),
        "sysv": lambda: SysvCollector(paths, node_mode=node, table=table),
        "host_memory": lambda: HostMemoryCollector(paths),
        "cgroup": lambda: CgroupCollector(
            paths,
            cfg.cgroup_path,
            cfg.cgroup_target_process,
            cfg.memory_limit_bytes,
            node_mode=node,
            table=table,
            mounts=discovery.mounts,
        ),
        "gpu": lambda: GpuCollector(paths, table=table),
        # serve: kills from now on; check: the kernel log ring from its start (recent kills)
        "oom": lambda: OomCollector(cfg.kmsg, from_start=kmsg_from_start),
    }
    sources = [discovery] + [
        make() for name, make in makers.items() if cfg.collectors.get(name, True)
    ]
    # The exporter's own process_* metrics are always on, read on the poll like the rest.
    return sources + [SelfProcessCollector()]


class App:
    def __init__(self, cfg: Config, kmsg_from_start: bool = False):
        self.cfg = cfg
        self.paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
        self.table = ProcessTable(self.paths)
        self.discovery = MountDiscovery(
            self.paths, cfg.shm_mounts, node_mode=cfg.mode == "node"
        )
        self.state = StateStore(cfg.peak_window)
        self.changes = (
            ChangeLog()
        )  # names the watcher saw change, for the next quick inventory
        self.sources = build_sources(
            cfg,
            self.paths,
            self.discovery,
            self.table,
            self.changes,
            kmsg_from_start,
            self.state,
        )
        self.sampler = Sampler(
            self.sources,
            cfg.poll_interval,
            cfg.inventory_interval,
            timeouts={"gpu": cfg.gpu_timeout},
            default_timeout=cfg.collector_timeout,
        )
        self.step = ModelStep(
            self.sources,
            self.discovery,
            self.state,
            cfg.top_k,
            cfg.shm_size_limit,
            cfg.memory_limit_bytes,
        )
        self.watcher = MountWatcher(
            self.state,
            self.paths,
            self.discovery.mounts,
            wake=self.sampler.request_quick,
            enabled=cfg.inotify,
            changes=self.changes,
            wake_full=self.sampler.request_full,
        )
        self.discovery.subscribe(self.watcher.on_mounts)
        self.sampler.subscribe(self.watcher.on_observation)
        self.sampler.subscribe(self.step.accept)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ModelCollector(self.step))
        # /metrics serves bytes rendered once per model change, not per scrape.
        self.exposition = Exposition(self.registry)
        self.step.on_change(self.exposition.changed)
        # Event-driven runs, like renders, are for the scrapes that read them; so are the
        # sources whose figures nothing keeps between scrapes.
        self.sampler.scrape_due = self.exposition.clock.next_due
        self.exposition.clock.on_unknown(self.sampler.schedule_ended)
        for source in self.sources:
            if source.name == "cgroup" and cfg.mode == "node":
                source.scrape_aligned = self._kill_log_complete
            elif source.name == "segments":
                source.scrape_aligned = self.state.all_inotify

    def _kill_log_complete(self) -> bool:
        """The kernel log is read, and its last read lost nothing: it counts every OOM kill."""
        runner = self.sampler.runners.get("oom")
        if runner is None or not runner.last_ok or runner.timed_out:
            return False
        reports = runner.last_result
        return reports is not None and reports.lost == 0

    def start(self) -> None:
        try:
            self.discovery.collect()  # the first mount set, before anything is watched
        except (OSError, ValueError):
            pass  # the sampler runs it again, and reports it failed
        self.watcher.start()
        self.exposition.start()
        self.sampler.start()

    def run_once(self) -> None:
        """Every source once, in this thread (`shmwatch check`, tests)."""
        self.sampler.run_once()

    def stop(self) -> None:
        self.watcher.stop()
        self.sampler.stop()
        self.exposition.stop()
        for source in self.sources:
            close = getattr(source, "close", None)
            if close is not None:
                close()
