"""Run sources once against a tree and read the values back from a fresh registry; run a
world of real processes in namespaces of its own (tests/peers/world.py)."""
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any, Dict, Set

from prometheus_client.registry import CollectorRegistry

from exporter.collectors.discovery import MountDiscovery
from exporter.exposition.metrics import ModelCollector
from exporter.model.step import ModelStep
from exporter.host.paths import Paths
from exporter.runtime.scheduler import Sampler
from exporter.model.state import StateStore
from tests.conftest import REPO


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


WORLD = os.path.join(REPO, "tests", "peers", "world.py")


def run_world(cell: Dict[str, Any], timeout: float = 120) -> Dict[str, Any]:
    """tests/peers/world.py for `cell`, as pid 1 of PID, mount and IPC namespaces of its own
    (nothing it mounts or starts outlives it): its report."""
    argv = ["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--ipc"]
    done = subprocess.run([*argv, sys.executable, WORLD, json.dumps(cell)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0 and done.stdout, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def mount_facts(doc: Dict[str, Any], mount: str = "/dev/shm") -> Dict[str, Any]:
    """`shmwatch check --output=json`'s facts of one mount."""
    [facts] = [m for m in doc["shm"] if m["mount"] == mount]
    return facts


def removal_advised(doc: Dict[str, Any]) -> Set[str]:
    """The paths `shmwatch check` advises to `rm`."""
    return {path for f in doc["findings"] if " rm " in f" {f['remedy']}"
            for path in f["remedy"].split(" rm ", 1)[1].split() if path.startswith("/")}
