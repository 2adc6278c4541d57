"""`shmwatch check`: the operator's four questions in one command, and a preflight.

Runs every collector once and prints what is wrong, worst first, each problem with its
remedy: GPU memory; /dev/shm size, use, classes, leaked and hidden segments; host and
cgroup headroom and the shm OOM projection; SysV limits; and known failure signatures
in server logs (--log).

Exit codes: 0 all good, 1 warnings, 2 a requirement failed (--require-shm, --backend),
64 a usage error (EX_USAGE: kept apart from 2 on purpose, so an initContainer can tell
"this pod's shm is too small" from "the command line is wrong").
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from . import __version__
from .budget import cgroup_for_mount, shm_budget
from .config import Config, _typed, build_parser, parse_args, parse_size

EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_USAGE = 0, 1, 2, 64
SEVERITY_ORDER = {"fail": 0, "warn": 1, "info": 2, "ok": 3}
DOCKER_DEFAULT_SHM = 64 << 20
# Recommended shm per backend. vLLM's and SGLang's docs ask for `--ipc=host` or a
# `--shm-size` without naming a number; 16Gi is this project's default for tensor-parallel
# serving (NCCL segments plus the engines' shared-memory message queues and multimodal
# caches). TensorRT-LLM (multi-GPU, with its own shm-based IPC) gets 80Gi, the figure this
# project's operators use; NVIDIA's own large-model examples go higher still.
BACKEND_SHM = {"vllm": 16 << 30, "sglang": 16 << 30, "trtllm": 80 << 30}
GiB, MiB = 1 << 30, 1 << 20


def human(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def k8s_size(n: int) -> str:
    return f"{n // GiB}Gi" if n % GiB == 0 else f"{max(1, n // MiB)}Mi"


def shm_remedy(size: int) -> str:
    g = max(1, -(-size // GiB))
    return (f"docker run --shm-size={g}g (or --ipc=host); compose shm_size: {g}gb; Kubernetes: an emptyDir "
            f"{{medium: Memory, sizeLimit: {k8s_size(size)}}} mounted at /dev/shm")


@dataclass
class Finding:
    severity: str  # fail | warn | info | ok
    area: str  # gpu | shm | memory | sysv | log
    subject: str
    message: str
    remedy: str = ""


# --- log signatures ------------------------------------------------------------------------
# Each: (name, regex, explanation, remedy). The formats are quoted from the libraries.
SIGNATURES = (
    # NCCL src/misc/shmutils.cc: "Error while creating shared memory segment /dev/shm/nccl-XXXXXX
    # (size N), error: No space left on device (28)"; older builds: "include/shm.h ... Error while
    # creating shared memory segment nccl-shm-recv-... (size N)".
    ("nccl_shm_create", re.compile(r"NCCL WARN Error while (creating|attaching to) shared memory segment (\S+)"),
     "NCCL could not create or attach a shared-memory segment: /dev/shm is too small or full.",
     "raise the shm size (--shm-size / shm_size / emptyDir sizeLimit) or remove leaked nccl-* segments; "
     "NCCL_SHM_DISABLE=1 only as a last resort"),
    # NCCL shmutils.cc: "Error: failed to extend /dev/shm/nccl-XXXXXX to N bytes"; NCCL <= 2.11
    # include/shm.h: "Call to posix_fallocate failed : No space left on device".
    ("nccl_shm_extend", re.compile(r"failed to extend (/dev/shm/nccl-\S+)|Call to posix_fallocate failed"),
     "NCCL ran out of /dev/shm while sizing a segment.",
     "raise the shm size; Docker's 64 MiB default is far too small for NCCL"),
    # UCX src/ucs/sys/sys.c: "shmget(size=N flags=0x7b0) for mm_recv_desc failed: No space left on
    # device, please check shared memory limits by 'ipcs -l'"
    ("ucx_shmget", re.compile(r"shmget\(size=(\d+) flags=0x[0-9a-f]+\) for \S+ failed: (No space left on device|"
                              r"Cannot allocate memory|Operation not permitted|Invalid argument)"),
     "UCX's SysV transport hit a SysV shared-memory limit (kernel.shmmni / shmall / shmmax).",
     "ipcs -m and ipcrm -m <id> for orphans; sysctl kernel.shmmni / kernel.shmall; or UCX_TLS without sysv"),
    # UCX src/uct/sm/mm/posix: "Not enough memory to write total of N bytes. Please check that
    # /dev/shm or the directory you specified has more available memory."
    ("ucx_posix", re.compile(r"Not enough memory to write total of (\d+) bytes"),
     "UCX's posix transport could not size a segment in /dev/shm.", "raise the shm size"),
    # Generic wording used by several runtimes (DALI, Triton python backend, custom allocators).
    ("shm_alloc", re.compile(r"Failed to allocate shared memory", re.I),
     "A shared-memory allocation failed.", "check /dev/shm size and use; raise it or remove leaked segments"),
    # vLLM's shm checks before starting workers.
    ("vllm_insufficient_shm", re.compile(r"Insufficient space in /dev/shm", re.I),
     "vLLM found too little free space in /dev/shm (often leaked segments from a crashed run).",
     "remove leaked segments (shmwatch check lists them) or raise the shm size"),
    # SIGBUS: a process touched a page of a tmpfs file that tmpfs could not back. PyTorch's
    # DataLoader says "Unexpected bus error encountered in worker. This might be caused by
    # insufficient shared memory (shm)"; a plain process dies with "Bus error (core dumped)".
    ("bus_error", re.compile(r"Bus error|bus error encountered in worker", re.I),
     "SIGBUS: a mapped shm page could not be backed — /dev/shm filled while in use.",
     "raise the shm size; find what filled it with shmwatch_top_segment_bytes"),
    # PyTorch: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB";
    # CUDA runtime: "CUDA error: out of memory".
    ("cuda_oom", re.compile(r"CUDA out of memory|CUDA error: out of memory"),
     "The GPU ran out of memory (not shared memory).",
     "lower --gpu-memory-utilization / max batch or context; check other GPU processes"),
    # CPython multiprocessing/resource_tracker.py: "resource_tracker: There appear to be N leaked
    # shared_memory objects to clean up at shutdown"
    ("leaked_shared_memory", re.compile(r"resource_tracker: There appear to be (\d+) leaked shared_memory objects"),
     "Python's resource tracker found shared_memory segments nobody unlinked: a process exited uncleanly.",
     "check /dev/shm for leftover psm_* segments and remove them"),
)


@dataclass
class LogHit:
    file: str
    line: int
    signature: str
    text: str


def scan_log(path: str, max_hits_per_signature: int = 5) -> Dict[str, List[LogHit]]:
    """Stream a log line by line (large logs are never loaded whole)."""
    hits: Dict[str, List[LogHit]] = {}
    counts: Dict[str, int] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            for name, pattern, _, _ in SIGNATURES:
                if pattern.search(line):
                    counts[name] = counts.get(name, 0) + 1
                    if counts[name] <= max_hits_per_signature:
                        hits.setdefault(name, []).append(LogHit(path, number, name, line.strip()[:300]))
    for name, n in counts.items():
        hits[name][0].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return hits


# --- diagnosis --------------------------------------------------------------------------------
@dataclass
class Report:
    findings: List[Finding] = field(default_factory=list)
    facts: Dict[str, object] = field(default_factory=dict)

    def add(self, *args, **kwargs) -> None:
        self.findings.append(Finding(*args, **kwargs))

    @property
    def exit_code(self) -> int:
        severities = {f.severity for f in self.findings}
        return EXIT_FAIL if "fail" in severities else EXIT_WARN if "warn" in severities else EXIT_OK

    def sorted(self) -> List[Finding]:
        return sorted(self.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.area, f.subject))


def diagnose(states: Dict[str, object], cfg: Config, required: Optional[int], required_by: str,
             log_hits: Dict[str, List[LogHit]]) -> Report:
    report = Report()
    ok = {name: s.result for name, s in states.items() if s.success and s.result is not None}
    errors = {name: s.error for name, s in states.items() if not s.success}
    _gpu(report, ok.get("gpu"), errors.get("gpu"))
    cgroup = ok.get("cgroup")
    mounts = ok.get("shm_mount") or []
    inventory = ok.get("segments")
    pods = cgroup if isinstance(cgroup, list) else None  # node mode: every pod's cgroup
    for m in mounts:
        _shm(report, m, inventory, cgroup_for_mount(m.mount, cgroup), cfg, required, required_by,
             memory_limit=None if pods is not None else cfg.memory_limit_bytes)
    if pods is not None:
        _pod_memory(report, pods)
        cgroup = None
    _memory(report, ok.get("host_memory"), cgroup, mounts, cfg, errors.get("cgroup"))
    _sysv(report, ok.get("sysv"))
    for name, hits in log_hits.items():
        _, _, explanation, remedy = next(s for s in SIGNATURES if s[0] == name)
        first = hits[0]
        report.add("warn", "log", f"{os.path.basename(first.file)}:{first.line}",
                   f"{explanation} Seen: {first.text}", remedy)
    areas = {"sysv": "sysv", "host_memory": "memory", "shm_mount": "shm", "segments": "shm"}
    for name, error in errors.items():
        # gpu and cgroup are reported above, as info: no driver, or no readable cgroup, is normal
        if name not in ("gpu", "cgroup"):
            report.add("warn", areas.get(name, "shm"), f"collector {name}", f"could not be read: {error}")
    return report


def _gpu(report: Report, gpus, error: Optional[str]) -> None:
    if gpus is None:
        if error:
            report.add("info", "gpu", "NVML", f"GPU memory not checked: {error}")
        return
    report.facts["gpus"] = [asdict(d) for d in gpus.devices]
    for d in gpus.devices:
        ratio = d.used_bytes / d.total_bytes if d.total_bytes else 0
        text = f"{human(d.used_bytes)} of {human(d.total_bytes)} used ({ratio:.0%})"
        if ratio > 0.98:
            report.add("warn", "gpu", f"GPU {d.gpu} {d.name}", text + ": less than 2 % free",
                       "lower --gpu-memory-utilization or stop the other GPU processes")
        else:
            report.add("ok", "gpu", f"GPU {d.gpu} {d.name}", text)
    for skipped in gpus.errors:
        report.add("warn", "gpu", "NVML", f"GPU skipped: {skipped}", "nvidia-smi; dmesg | grep -i xid")


def _shm(report: Report, m, inventory, cgroup, cfg: Config, required: Optional[int], required_by: str,
         memory_limit: Optional[int]) -> None:
    if m.error:
        report.add("fail" if required else "warn", "shm", m.mount, f"cannot be measured: {m.error}",
                   "mount the workload's shm volume at this path")
        return
    effective = shm_budget(m, cgroup, cfg.shm_size_limit, memory_limit).effective_bytes
    size_text = human(m.size_bytes)
    if m.size_bytes <= DOCKER_DEFAULT_SHM:
        size_text += " (Docker's 64 MiB default)" if m.size_bytes == DOCKER_DEFAULT_SHM else " (below Docker's 64 MiB default)"
    usage = f"{size_text}, {human(m.used_bytes)} used ({m.usage_ratio:.0%})"
    facts = {"mount": m.mount, "fstype": m.fstype, "size_bytes": m.size_bytes, "used_bytes": m.used_bytes,
             "available_bytes": m.available_bytes, "effective_size_bytes": effective}
    if required and effective < required:
        report.add("fail", "shm", m.mount, f"{usage}: can hold {human(effective)}, below the {human(required)} "
                   f"required ({required_by})", shm_remedy(required))
    elif m.size_bytes <= DOCKER_DEFAULT_SHM:
        report.add("warn", "shm", m.mount, f"{usage}: far too small for NCCL, torch or vLLM", shm_remedy(16 << 30))
    if m.usage_ratio > 0.95:
        report.add("fail" if required else "warn", "shm", m.mount, f"{usage}: about to be full",
                   "remove leaked segments (below) or raise the size")
    elif m.usage_ratio > 0.8:
        report.add("warn", "shm", m.mount, f"{usage}: above 80 %", "remove leaked segments or raise the size")
    if m.fstype != "tmpfs":
        report.add("warn", "shm", m.mount, f"is {m.fstype}, not tmpfs", "mount a tmpfs (or memory emptyDir) here")
    inv = next((i for i in (inventory.mounts if inventory else []) if i.mount == m.mount), None)
    if inv is not None and not inv.error:
        by_class: Dict[str, int] = {}
        for seg in inv.segments:
            by_class[seg.cls] = by_class.get(seg.cls, 0) + seg.allocated_bytes
        orphans = sorted((s for s in inv.segments if s.state == "orphan" and s.cls != "semaphore"),
                         key=lambda s: -s.allocated_bytes)
        hidden = [s for s in inv.segments if s.state == "hidden"]
        facts.update(bytes_by_class=by_class, orphans=[{"name": s.name, "class": s.cls, "bytes": s.allocated_bytes,
                                                        "age_seconds": max(0, int(time.time() - s.mtime))}
                                                       for s in orphans],
                     hidden_bytes=sum(s.allocated_bytes for s in hidden), segments=len(inv.segments),
                     unattributed_bytes=inv.unattributed_bytes)
        classes = ", ".join(f"{c} {human(b)}" for c, b in sorted(by_class.items(), key=lambda kv: -kv[1]) if b)
        if not any(f.area == "shm" and f.subject == m.mount and f.severity in ("fail", "warn")
                   for f in report.findings):
            report.add("ok", "shm", m.mount, usage + (f"; by class: {classes}" if classes else ""))
        if orphans:
            names = " ".join(os.path.join(m.mount, s.name) for s in orphans[:5])
            more = f" (+{len(orphans) - 5} more)" if len(orphans) > 5 else ""
            report.add("warn", "shm", m.mount, f"{len(orphans)} leaked segment(s) held by no process, "
                       f"{human(sum(s.allocated_bytes for s in orphans))}: {names}{more}",
                       f"once no server can attach to them: rm {names}")
        if hidden:
            report.add("info", "shm", m.mount, f"{len(hidden)} unlinked-but-mapped segment(s), "
                       f"{human(facts['hidden_bytes'])}: counted by df, invisible to ls "
                       f"(NCCL >= 2.19, UCX proc link, torch file_descriptor)")
    elif not any(f.subject == m.mount for f in report.findings):
        report.add("ok", "shm", m.mount, usage)
    report.facts.setdefault("shm", []).append(facts)


def _memory(report: Report, host, cgroup, mounts, cfg: Config, cgroup_error: Optional[str]) -> None:
    if host is not None:
        ratio = host.available_bytes / host.total_bytes if host.total_bytes else 1
        report.facts["host_memory"] = asdict(host)
        text = f"{human(host.available_bytes)} of {human(host.total_bytes)} available ({ratio:.0%}), " \
               f"shmem {human(host.shmem_bytes)}"
        report.add("warn" if ratio < 0.1 else "ok", "memory", "host", text,
                   "free leaked shm, move workloads" if ratio < 0.1 else "")
    if cgroup is None:
        if cgroup_error:
            report.add("info", "memory", "cgroup", f"not read: {cgroup_error}")
        return
    report.facts["cgroup"] = asdict(cgroup)
    if not cgroup.limit_bytes:
        report.add("info", "memory", cgroup.cgroup, f"working set {human(cgroup.working_set_bytes)}, no memory limit: "
                   "OOM ratios not computed (pass --memory.limit-bytes)")
        return
    risk = cgroup.working_set_bytes / cgroup.limit_bytes
    text = f"working set {human(cgroup.working_set_bytes)} of {human(cgroup.limit_bytes)} limit ({risk:.0%})"
    if cgroup.shmem_bytes is not None:
        text += f", shmem {human(cgroup.shmem_bytes)}"
    report.add("warn" if risk > 0.9 else "ok", "memory", cgroup.cgroup, text,
               "raise the memory limit or free shm" if risk > 0.9 else "")
    if cgroup.oom_kills:
        report.add("warn", "memory", cgroup.cgroup, f"{cgroup.oom_kills} OOM kill(s) so far",
                   "count /dev/shm in the memory budget")
    for m in mounts:
        if m.error:
            continue
        budget = shm_budget(m, cgroup, cfg.shm_size_limit)
        if budget.projection is not None and budget.projection > 1:
            report.add("warn", "memory", m.mount, f"filling it ({human(budget.fillable_bytes)}) would need "
                       f"{budget.projection:.0%} of the memory limit: the pod is OOM-killed before tmpfs says ENOSPC",
                       f"lower sizeLimit to at most {human(budget.room_bytes)} or raise the memory limit")


def _pod_memory(report: Report, pods) -> None:
    report.facts["pod_cgroups"] = [asdict(c) for c in pods]
    risky = 0
    for c in pods:
        if c.limit_bytes and c.working_set_bytes / c.limit_bytes > 0.9:
            risky += 1
            report.add("warn", "memory", f"pod {c.pod_uid}", f"working set {human(c.working_set_bytes)} of "
                       f"{human(c.limit_bytes)} limit ({c.working_set_bytes / c.limit_bytes:.0%})",
                       "raise the pod's memory limit or free its shm")
        if c.oom_kills:
            report.add("warn", "memory", f"pod {c.pod_uid}", f"{c.oom_kills} OOM kill(s) so far",
                       "count /dev/shm in the memory budget")
    if not risky:
        report.add("ok", "memory", "pods", f"{len(pods)} pod cgroup(s), none above 90 % of its limit")


def _sysv(report: Report, sysv) -> None:
    if sysv is None:
        return
    report.facts["sysv"] = {"segments": len(sysv.segments), "bytes": sysv.total_bytes, "orphans": sysv.orphans,
                            "shmmax_bytes": sysv.shmmax_bytes, "shmall_bytes": sysv.shmall_bytes,
                            "shmmni": sysv.shmmni}
    text = f"{len(sysv.segments)} segment(s), {human(sysv.total_bytes)}"
    if sysv.shmmni and len(sysv.segments) > 0.9 * sysv.shmmni:
        report.add("warn", "sysv", "kernel.shmmni", f"{text}: near the limit of {sysv.shmmni}",
                   "ipcs -m; ipcrm -m <id> for orphans; sysctl -w kernel.shmmni=8192")
    elif sysv.shmall_bytes and sysv.total_bytes > 0.9 * sysv.shmall_bytes:
        report.add("warn", "sysv", "kernel.shmall", f"{text}: near the limit of {human(sysv.shmall_bytes)}",
                   "ipcs -m; ipcrm -m <id>; sysctl kernel.shmall")
    else:
        report.add("ok", "sysv", "SysV shm", text + (f", {sysv.orphans} with nothing attached" if sysv.orphans else ""),
                   "ipcs -m; ipcrm -m <id>" if sysv.orphans else "")


# --- output -----------------------------------------------------------------------------------
def render_text(report: Report) -> str:
    findings = report.sorted()
    lines = [f"shmwatch check {__version__}: {len([f for f in findings if f.severity in ('fail', 'warn')])} "
             f"problem(s), worst first", "", f"{'STATUS':<7}{'AREA':<8}{'SUBJECT':<28}WHAT"]
    for f in findings:
        lines.append(f"{f.severity.upper():<7}{f.area:<8}{f.subject[:27]:<28}{f.message}")
        if f.remedy:
            lines.append(f"{'':<43}-> {f.remedy}")
    return "\n".join(lines) + "\n"


def render_json(report: Report) -> str:
    code = report.exit_code
    doc = {
        "version": 1,
        "shmwatch_version": __version__,
        "status": {EXIT_OK: "ok", EXIT_WARN: "warn", EXIT_FAIL: "fail"}[code],
        "exit_code": code,
        "findings": [asdict(f) for f in report.sorted()],
        "shm": report.facts.get("shm", []),
        "gpus": report.facts.get("gpus", []),
        "host_memory": report.facts.get("host_memory"),
        "cgroup": report.facts.get("cgroup"),
        "pod_cgroups": report.facts.get("pod_cgroups", []),
        "sysv": report.facts.get("sysv"),
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = build_parser(prog="shmwatch check")
    parser.usage_exit_code = EXIT_USAGE
    parser.add_argument("--require-shm", type=_typed(parse_size, "--require-shm"), default=None,
                        help="Fail (exit 2) when the shm mount can hold less than this, e.g. 16Gi.")
    parser.add_argument("--backend", choices=sorted(BACKEND_SHM), default=None,
                        help="Warn when shm is below what this serving engine needs (vllm/sglang 16Gi, trtllm 80Gi).")
    parser.add_argument("--output", choices=("text", "json"), default="text")
    parser.add_argument("--log", action="append", default=[], metavar="FILE",
                        help="Scan a server log for known shared-memory and OOM failure signatures (repeatable).")
    parser.add_argument("--timeout", type=float, default=None, help="Seconds to wait for all collectors.")
    cfg, extra = parse_args(list(argv), parser=parser)
    import logging
    logging.basicConfig(level=logging.CRITICAL)  # failures are in the report, not on stderr
    for path in extra.log:
        if not os.access(path, os.R_OK):
            sys.stderr.write(f"shmwatch check: error: argument --log: cannot read {path}\n")
            return EXIT_USAGE
    from .app import build_collectors
    from .paths import Paths
    from .sampler import Sampler

    paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
    sampler = Sampler(build_collectors(cfg, paths), timeouts={"gpu": cfg.gpu_timeout},
                      default_timeout=cfg.collector_timeout)
    sampler.start()
    timeout = extra.timeout if extra.timeout is not None else max(cfg.gpu_timeout, cfg.collector_timeout) + 1
    sampler.wait_for_first_run(timeout)
    snapshot = sampler.snapshot()
    for state in snapshot.states.values():
        if state.runs == 0 and state.error is None:
            state.success, state.error = False, f"no result within {timeout:g}s"
    sampler.stopping.set()
    for collector in sampler.collectors.values():
        close = getattr(collector, "close", None)
        if close and not (snapshot.states[collector.name].running_since):
            close()
    required, required_by = extra.require_shm, "--require-shm"
    log_hits: Dict[str, List[LogHit]] = {}
    for path in extra.log:
        for name, hits in scan_log(path).items():
            log_hits.setdefault(name, []).extend(hits)
    report = diagnose(snapshot.states, cfg, required, required_by, log_hits)
    if extra.backend:
        need = BACKEND_SHM[extra.backend]
        for facts in report.facts.get("shm", []):
            if facts["effective_size_bytes"] < need and not (required and required >= need):
                report.add("warn", "shm", facts["mount"],
                           f"can hold {human(facts['effective_size_bytes'])}, under the {human(need)} recommended "
                           f"for {extra.backend}", shm_remedy(need))
    sys.stdout.write(render_json(report) if extra.output == "json" else render_text(report))
    return report.exit_code

