"""Wires what docs/architecture.md draws: sources, scheduler, watcher, state, model."""

import logging
from contextlib import suppress

from prometheus_client.registry import CollectorRegistry

from exporter.collectors import REGISTRY, Context
from exporter.collectors.host_memory import usable_limit_flag
from exporter.collectors.discovery import MountDiscovery
from exporter.config import Config
from exporter.exposition.metrics import ModelCollector
from exporter.exposition.render import Exposition
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.inventory.changes import ChangeLog
from exporter.model.catalogue import MetricSelection
from exporter.model.state import StateStore
from exporter.model.step import ModelStep
from exporter.runtime.memory import MemoryGiveBack
from exporter.runtime.scheduler import Sampler
from exporter.runtime.watcher import MountWatcher

log = logging.getLogger(__name__)


class App:
    def __init__(self, cfg: Config, kmsg_from_start: bool = False, web=None):
        self.paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
        self.discovery = MountDiscovery(self.paths, cfg.shm_mounts, cfg.mode == "node")
        self.state = StateStore(cfg.peak_window)
        changes = ChangeLog()  # names the watcher saw change, for the quick inventory
        context = Context(
            cfg,
            self.paths,
            self.discovery.mounts,
            ProcessTable(self.paths),
            changes,
            self.state.drain_touched,
            self.state.all_inotify,
            kmsg_from_start,
            lambda: self.step.kill_log_complete(),  # the step is made below
            usable_limit_flag(self.paths, cfg.memory_limit_bytes),
        )
        # Discovery first: the others read its mounts. A collector without a flag is always on.
        on = [r for r in REGISTRY.values() if cfg.collectors.get(r.name, True)]
        self.sources = [self.discovery] + [r.factory(context) for r in on]
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
            context.memory_limit,
        )
        self.watcher = MountWatcher(
            self.state,
            self.paths,
            self.discovery.mounts,
            wake=self.sampler.request,
            enabled=cfg.inotify,
            changes=changes,
        )
        self.sampler.subscribe(self.watcher.on_observation)
        self.sampler.subscribe(self.step.accept)
        # After the step: the inventory it no longer holds is freed by then.
        self.give_back = MemoryGiveBack()
        self.sampler.subscribe(self.give_back.on_observation)
        self.registry = CollectorRegistry(auto_describe=False)
        selection = MetricSelection(
            allowlist=cfg.metric_allowlist,
            denylist=cfg.metric_denylist,
            opt_in=cfg.metric_opt_in_list,
        )
        exposed = selection.exposed()
        for warning in selection.warnings():
            log.warning("%s", warning)
        self.registry.register(ModelCollector(self.step, exposed))
        self.web = web  # its files watched from start() to stop()
        if web is not None:  # its reload metric: rendered again when a reload moves it
            self.registry.register(web)
        self.exposition = Exposition(
            self.registry,
            version=lambda: (self.step.version(), web and web.generation),
            exposed=exposed,
        )

    def start(self, watch: bool = True) -> None:
        with suppress(OSError, ValueError):  # reported when the scheduler runs it
            self.discovery.collect()  # the first mount set, before anything is watched
        if watch:  # the mount sets discovery publishes from here on
            self.discovery.subscribe(self.watcher.on_mounts)
            self.watcher.start()
        self.sampler.start()
        if self.web is not None:
            self.web.start()

    def stop(self, wait: float = 1.0) -> None:
        self.watcher.stop()
        if self.web is not None:
            self.web.stop()
        # Busy sources stay open: close() races a run; nvmlShutdown hangs on a lost GPU.
        busy = self.sampler.stop(wait)
        for source in self.sources:
            if source.name not in busy:
                source.close()
