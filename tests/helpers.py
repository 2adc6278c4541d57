"""Run sources once against a tree and read the values back from a fresh registry; run a
world of real processes in namespaces of its own (tests/peers/world.py); find private
attributes of other packages a module uses; drive a real shmwatch process through a leak
storm and read its memory."""
import ast
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from prometheus_client.registry import CollectorRegistry

from exporter.collectors.discovery import MountDiscovery
from exporter.exposition.metrics import ModelCollector
from exporter.model.step import ModelStep
from exporter.host.paths import Paths
from exporter.runtime.scheduler import Sampler
from exporter.model.state import StateStore
from exporter.inventory.walk import MAX_ENTRIES
from tests.conftest import REPO, Exporter, Samples, select


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


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _defined_privates(tree: ast.AST) -> Set[str]:
    """Private names a module makes itself: functions, classes, names it assigns, and
    attributes it assigns on its own objects (`self._x = ...`, `cls._x = ...`)."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and getattr(node.value, "id", None) in ("self", "cls")):
            names.add(node.attr)
    return {name for name in names if _private(name)}


ATTRIBUTE_BUILTINS = ("getattr", "hasattr", "setattr", "delattr")


def _private_uses(tree: ast.AST) -> Iterator[Tuple[int, Optional[str], str]]:
    """(line, the private attribute or None for an import, what) for each private name a
    module reaches: `x._y`, getattr(x, "_y") and its kin, imports of a private name or module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            yield node.lineno, node.attr, f"{ast.unparse(node)}"
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_BUILTINS:
            named = node.args[1] if len(node.args) > 1 else None
            if isinstance(named, ast.Constant) and isinstance(named.value, str) and _private(named.value):
                yield node.lineno, named.value, ast.unparse(node)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if any(_private(part) for part in alias.name.split(".")):
                    yield node.lineno, None, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [alias.name for alias in node.names]
            if any(_private(part) for part in (node.module or "").split(".") + names):
                yield node.lineno, None, f"from {node.module} import {', '.join(names)}"


def private_attributes_of_other_packages(path: str) -> List[str]:
    """`path:line: code` for each private name (`_x`, not a dunder) the module at `path`
    reaches but does not define itself: another package's internals (asyncio's
    `_ssl_protocol`), by attribute, by getattr/hasattr/setattr/delattr with a constant, or
    by import. The check is by name: a private the module defines passes wherever used."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    own = _defined_privates(tree)
    return [f"{path}:{line}: {code}" for line, name, code in _private_uses(tree) if name is None or name not in own]


@dataclass(frozen=True)
class StormRss:
    """A shmwatch process's resident memory (MiB) through a leak storm in one mount."""

    files: int
    before: float  # before the files were made
    full: float  # once the exporter counted them (or as many as one walk reaches)
    peak: float  # the highest since the process started (VmHWM)
    after: float  # `settle` seconds after the exporter saw the last one gone
    # (seconds after the exporter saw them gone, RSS) each second of the settle
    trace: Tuple[Tuple[float, float], ...] = ()


def status_mib(pid: int, key: str) -> float:
    """A process's VmRSS or VmHWM, in MiB."""
    with open(f"/proc/{pid}/status") as f:
        line = next(line for line in f if line.startswith(key + ":"))
    return int(line.split()[1]) / 1024


def segments_counted(samples: Samples, mount: str) -> float:
    return sum(v for _, v in select(samples, "shmwatch_segments", mount=mount))


def make_files(shm: str, names: Sequence[str]) -> None:
    for name in names:
        os.close(os.open(os.path.join(shm, name), os.O_CREAT | os.O_WRONLY, 0o600))


def leak_storm(exporter: Exporter, shm: str, files: int, settle: float = 60.0,
               back: Optional[float] = None) -> StormRss:
    """`files` empty files made in `shm` (scraped every 10,000, as Prometheus would scrape
    meanwhile), counted, deleted; then `settle` seconds of scrapes once every second, or
    fewer once RSS is `back` MiB or less above where it was before."""
    pid, names = exporter.proc.pid, [f"psm_{i:08x}" for i in range(files)]
    reached = min(files, MAX_ENTRIES)  # a walk stops there: counted as far as it reached
    for _ in range(3):  # the renders' caches as a steady exporter's
        exporter.scrape()
        time.sleep(0.3)
    before = status_mib(pid, "VmRSS")
    for start in range(0, files, 10_000):
        make_files(shm, names[start : start + 10_000])
        exporter.scrape()
    exporter.wait_for(lambda s: segments_counted(s, shm) >= reached, timeout=240, interval=0.5)
    full = status_mib(pid, "VmRSS")
    for name in names:
        os.unlink(os.path.join(shm, name))
    exporter.wait_for(lambda s: segments_counted(s, shm) == 0, timeout=240, interval=0.5)
    gone, trace = time.monotonic(), []
    while (since := time.monotonic() - gone) < settle:
        exporter.scrape()
        trace.append((round(since, 1), status_mib(pid, "VmRSS")))
        if back is not None and trace[-1][1] - before <= back:
            break
        time.sleep(min(1.0, max(0.0, settle - since)))
    after = status_mib(pid, "VmRSS")
    peak = status_mib(pid, "VmHWM")
    return StormRss(files, before, full, peak, after, tuple(trace))
