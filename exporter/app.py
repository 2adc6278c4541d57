"""Wires what docs/architecture.md draws, one way through: sources -> scheduler ->
observations -> the run inputs, the watcher, the model step and the memory give-back (its
subscribers, in that order) -> exposition. The watcher asks the scheduler for runs."""

import logging
from contextlib import suppress
from typing import List, Optional, cast

from prometheus_client.registry import Collector, CollectorRegistry

from exporter.collectors import REGISTRY, Context, Source
from exporter.collectors.discovery import MountDiscovery
from exporter.collectors.host_memory import usable_limit_flag
from exporter.config import Config
from exporter.exposition.metrics import ModelCollector
from exporter.exposition.render import Exposition
from exporter.exposition.webconfig import WebConfigSource
from exporter.host.paths import Paths
from exporter.host.proctable import ProcessTable
from exporter.model.catalogue import MetricSelection
from exporter.model.state import StateStore
from exporter.model.step import ModelStep
from exporter.runtime.memory import MemoryGiveBack
from exporter.runtime.scheduler import Sampler
from exporter.runtime.watcher import MountWatcher

log = logging.getLogger(__name__)


class App:
    def __init__(
        self,
        cfg: Config,
        kmsg_from_start: bool = False,
        web: Optional[WebConfigSource] = None,
    ) -> None:
        self.paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
        self.discovery = MountDiscovery(self.paths, cfg.shm_mounts, cfg.mode == "node")
        self.state = StateStore(cfg.peak_window)
        context = Context(
            cfg=cfg,
            paths=self.paths,
            table=ProcessTable(self.paths),
            kmsg_from_start=kmsg_from_start,
            memory_limit=usable_limit_flag(self.paths, cfg.memory_limit_bytes),
        )
        # Discovery first: every other source's runs are handed the mounts it found. A
        # collector without a flag is always on.
        on = [r for r in REGISTRY.values() if cfg.collectors.get(r.name, True)]
        self.sources: List[Source] = [self.discovery] + [r.factory(context) for r in on]
        self.sampler = Sampler(
            self.sources,
            cfg.poll_interval,
            cfg.inventory_interval,
            timeouts={"gpu": cfg.gpu_timeout},
            default_timeout=cfg.collector_timeout,
            mounts=cfg.shm_mounts,
        )
        self.step = ModelStep(
            [s.name for s in self.sources if s.reports_status],
            self.state,
            node_mode=context.node,
            top_k=cfg.top_k,
            shm_size_limit=cfg.shm_size_limit,
            memory_limit=context.memory_limit,
        )
        self.watcher = MountWatcher(
            self.state, self.paths, self.sampler, enabled=cfg.inotify
        )
        # The watcher first: it drops the inventory before (polled mounts' events) before
        # the step does, and the give-back, after the step, finds it freed.
        self.sampler.subscribe(self.watcher.on_observation)
        self.sampler.subscribe(self.step.accept)
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
            # Its families are exposition's, made as client_python's Metric is read.
            self.registry.register(cast(Collector, web))
        self.exposition = Exposition(
            self.registry,
            version=lambda: (self.step.version(), web and web.generation),
            exposed=exposed,
        )

    def start(self, watch: bool = True) -> None:
        """`watch`: inotify watches the mounts (the watcher takes discovery's sets from its
        first run on); `check` runs without."""
        if watch:
            self.watcher.start()
        self.sampler.start(first=[self.discovery.name])
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
                with suppress(Exception):
                    source.close()
