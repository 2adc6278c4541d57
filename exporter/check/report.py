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
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence

from exporter import __version__
from exporter.model import classes as segment_classes
from exporter.check import thresholds as T
from exporter.config import Config, typed, build_parser, parse_args, parse_size
from exporter.check.kernel import oom_kills as _oom_kills, sysv as _sysv
from exporter.check.logscan import SIGNATURES, LogHit, scan_log
from exporter.model.step import Model, MountView
from exporter.check import recommend as R

EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_USAGE = 0, 1, 2, 64
SEVERITY_ORDER = {"fail": 0, "warn": 1, "info": 2, "ok": 3}
DOCKER_DEFAULT_SHM = T.DOCKER_DEFAULT_SHM_BYTES
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
    return (
        f"docker run --shm-size={g}g (or --ipc=host); compose shm_size: {g}gb; Kubernetes: an emptyDir "
        f"{{medium: Memory, sizeLimit: {k8s_size(size)}}} mounted at /dev/shm"
    )


@dataclass
class Finding:
    severity: str  # fail | warn | info | ok
    area: str  # gpu | shm | memory | sysv | log
    subject: str
    message: str
    remedy: str = ""


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
        return (
            EXIT_FAIL
            if "fail" in severities
            else EXIT_WARN
            if "warn" in severities
            else EXIT_OK
        )

    def sorted(self) -> List[Finding]:
        return sorted(
            self.findings, key=lambda f: (SEVERITY_ORDER[f.severity], f.area, f.subject)
        )


def diagnose(
    model: Model,
    cfg: Config,
    required: Optional[int],
    required_by: str,
    log_hits: Dict[str, List[LogHit]],
) -> Report:
    """The report, from the model alone: no totals, thresholds or class rules of its own."""
    report = Report()
    errors = {s.name: s.error or "no result" for s in model.statuses if not s.success}
    _gpu(report, model.gpu, errors.get("gpu"))
    for view in model.mounts:
        if view.usage is not None:
            _shm(report, view, model, required, required_by)
    if model.node_mode:
        _pod_memory(report, model.cgroups, {c.cgroup: c.kills for c in model.oom_kills})
    _memory(report, model, errors.get("cgroup"))
    _oom_kills(report, model, errors.get("oom"))
    _sysv(report, model.sysv, model.node_mode)
    for name, hits in log_hits.items():
        _, _, explanation, remedy = next(s for s in SIGNATURES if s[0] == name)
        first = hits[0]
        report.add(
            "warn",
            "log",
            f"{os.path.basename(first.file)}:{first.line}",
            f"{explanation} Seen: {first.text}",
            remedy,
        )
    areas = {
        "sysv": "sysv",
        "host_memory": "memory",
        "shm_mount": "shm",
        "segments": "shm",
        "discovery": "shm",
    }
    for name, error in errors.items():
        # gpu and cgroup are reported above, as info: no driver, or no readable cgroup, is normal
        if name not in ("gpu", "cgroup", "process", "oom"):
            report.add(
                "warn",
                areas.get(name, "shm"),
                f"collector {name}",
                f"could not be read: {error}",
            )
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
        if ratio > T.GPU_MEMORY_FULL_RATIO:
            report.add(
                "warn",
                "gpu",
                f"GPU {d.gpu} {d.name}",
                text + ": less than 2 % free",
                "lower --gpu-memory-utilization or stop the other GPU processes",
            )
        else:
            report.add("ok", "gpu", f"GPU {d.gpu} {d.name}", text)
    for skipped in gpus.errors:
        report.add(
            "warn",
            "gpu",
            "NVML",
            f"GPU skipped: {skipped}",
            "nvidia-smi; dmesg | grep -i xid",
        )


def _shm(
    report: Report,
    view: MountView,
    model: Model,
    required: Optional[int],
    required_by: str,
) -> None:
    m = view.usage
    if m.error:
        report.add(
            "fail" if required else "warn",
            "shm",
            m.mount,
            f"cannot be measured: {m.error}",
            "mount the workload's shm volume at this path",
        )
        return
    effective = view.budget.effective_bytes
    size_text = human(m.size_bytes)
    if m.size_bytes <= DOCKER_DEFAULT_SHM:
        size_text += (
            " (Docker's 64 MiB default)"
            if m.size_bytes == DOCKER_DEFAULT_SHM
            else " (below Docker's 64 MiB default)"
        )
    usage = f"{size_text}, {human(m.used_bytes)} used ({m.usage_ratio:.0%})"
    facts = {
        "mount": m.mount,
        "fstype": m.fstype,
        "size_bytes": m.size_bytes,
        "used_bytes": m.used_bytes,
        "available_bytes": m.available_bytes,
        "effective_size_bytes": effective,
    }
    if required and effective < required:
        report.add(
            "fail",
            "shm",
            m.mount,
            f"{usage}: can hold {human(effective)}, below the {human(required)} "
            f"required ({required_by})",
            shm_remedy(required),
        )
    elif m.size_bytes <= DOCKER_DEFAULT_SHM:
        report.add(
            "warn",
            "shm",
            m.mount,
            f"{usage}: far too small for NCCL, torch or vLLM",
            shm_remedy(16 << 30),
        )
    if m.usage_ratio > T.SHM_USAGE_CRITICAL_RATIO:
        report.add(
            "fail" if required else "warn",
            "shm",
            m.mount,
            f"{usage}: about to be full",
            "remove leaked segments (below) or raise the size",
        )
    elif m.usage_ratio > T.SHM_USAGE_WARNING_RATIO:
        report.add(
            "warn",
            "shm",
            m.mount,
            f"{usage}: above {T.SHM_USAGE_WARNING_RATIO * 100:g} %",
            "remove leaked segments or raise the size",
        )
    if m.fstype != "tmpfs":
        report.add(
            "warn",
            "shm",
            m.mount,
            f"is {m.fstype}, not tmpfs",
            "mount a tmpfs (or memory emptyDir) here",
        )
    inv, summary = view.inventory, view.summary
    if inv is not None and not inv.error and summary is not None:
        by_class = summary.bytes_by_class
        leaked = summary.leaked
        wall = model.inventory.wall_time
        facts.update(
            bytes_by_class=dict(by_class),
            orphans=[
                {
                    "name": s.name,
                    "class": s.cls,
                    "bytes": s.allocated_bytes,
                    "age_seconds": max(0, int(wall - s.mtime)),
                }
                for s in leaked
            ],
            unverified=[
                {"name": s.name, "class": s.cls, "bytes": s.allocated_bytes}
                for s in summary.unverified
            ],
            hidden_bytes=summary.hidden_bytes,
            segments=len(inv.segments),
            unattributed_bytes=inv.unattributed_bytes,
        )
        classes = ", ".join(
            f"{c} {human(b)}"
            for c, b in sorted(by_class.items(), key=lambda kv: -kv[1])
            if b
        )
        if not any(
            f.area == "shm" and f.subject == m.mount and f.severity in ("fail", "warn")
            for f in report.findings
        ):
            report.add(
                "ok",
                "shm",
                m.mount,
                usage + (f"; by class: {classes}" if classes else ""),
            )
        _unowned(
            report,
            m.mount,
            leaked,
            summary.unverified,
            model.inventory.unproven,
            model.inventory.proc_unreadable,
        )
        if summary.hidden_count:
            report.add(
                "info",
                "shm",
                m.mount,
                f"{summary.hidden_count} unlinked-but-mapped segment(s), "
                f"{human(summary.hidden_bytes)}: counted by df, invisible to ls "
                f"(NCCL >= 2.19, UCX proc link, torch file_descriptor)",
            )
    elif not any(f.subject == m.mount for f in report.findings):
        report.add("ok", "shm", m.mount, usage)
    report.facts.setdefault("shm", []).append(facts)


def _names(mount: str, segments) -> str:
    names = " ".join(os.path.join(mount, s.name) for s in segments[:5])
    return names + (f" (+{len(segments) - 5} more)" if len(segments) > 5 else "")


MAX_NAMED = 5  # processes named in a finding (of the 20 the scan keeps)


def _unowned(
    report: Report,
    mount: str,
    leaked,
    unverified,
    unproven: List[str],
    unreadable: Optional[int],
) -> None:
    """Segments held by no process. `rm` is advised only where nothing can still attach: an
    orphan (every process inspected) of a class whose segments belong to one process."""
    removable = [s for s in leaked if segment_classes.removable(s.cls)]
    foreign = [s for s in leaked if not segment_classes.removable(s.cls)]
    if removable:
        names = _names(mount, removable)
        report.add(
            "warn",
            "shm",
            mount,
            f"{len(removable)} leaked segment(s) held by no process, "
            f"{human(sum(s.allocated_bytes for s in removable))}: {names}",
            f"once no server can attach to them: rm {names}",
        )
    if foreign:
        report.add(
            "info",
            "shm",
            mount,
            f"{len(foreign)} file(s) of no known owner class held by no process, "
            f"{human(sum(s.allocated_bytes for s in foreign))}: {_names(mount, foreign)}",
            "find which tool made them before removing anything (a container engine's lock file is one)",
        )
    if unverified:
        report.add(
            "info",
            "shm",
            mount,
            f"{len(unverified)} segment(s), "
            f"{human(sum(s.allocated_bytes for s in unverified))}, held by no process shmwatch could inspect "
            f"(could not read {_unreadable(unreadable, unproven)}): not called leaked, they may be live",
            "to tell live from leaked, run shmwatch as the server's UID or with CAP_SYS_PTRACE "
            "(README: Deploy); never remove them on this report's word",
        )


def _unreadable(count: Optional[int], unproven: List[str]) -> str:
    """'3 process(es): python3 (pid 7, uid 0); ...': how many, and the first few by name."""
    named = "; ".join(unproven[:MAX_NAMED])
    if (
        count is None
    ):  # the reasons say what could not be counted (hidepid, a PID namespace of its own)
        return named or "processes hidden from shmwatch, uncounted"
    total = f"{count} process(es)"
    more = " and more" if len(unproven) > MAX_NAMED or count > len(unproven) else ""
    return f"{total}: {named}{more}" if named else total


def _memory(report: Report, model: Model, cgroup_error: Optional[str]) -> None:
    host = model.host_memory
    if host is not None:
        ratio = host.available_bytes / host.total_bytes if host.total_bytes else 1
        report.facts["host_memory"] = asdict(host)
        low = ratio < T.HOST_MEMORY_AVAILABLE_LOW_RATIO
        text = (
            f"{human(host.available_bytes)} of {human(host.total_bytes)} available ({ratio:.0%}), "
            f"shmem {human(host.shmem_bytes)}"
        )
        report.add(
            "warn" if low else "ok",
            "memory",
            "host",
            text,
            "free leaked shm, move workloads" if low else "",
        )
    if model.node_mode:
        return  # every pod's cgroup is reported by _pod_memory
    cgroup = model.cgroups[0] if model.cgroups else None
    if cgroup is None:
        if cgroup_error:
            report.add("info", "memory", "cgroup", f"not read: {cgroup_error}")
        return
    report.facts["cgroup"] = asdict(cgroup)
    risk = cgroup.oom_risk_ratio
    if risk is None:
        report.add(
            "info",
            "memory",
            cgroup.cgroup,
            f"working set {human(cgroup.working_set_bytes)}, no memory limit: "
            "OOM ratios not computed (pass --memory.limit-bytes)",
        )
        return
    text = f"working set {human(cgroup.working_set_bytes)} of {human(cgroup.limit_bytes)} limit ({risk:.0%})"
    if cgroup.estimated:
        text += " (estimated: the workload's resident memory and shm; its cgroup is not readable here)"
    if cgroup.shmem_bytes is not None:
        text += f", shmem {human(cgroup.shmem_bytes)}"
    high = risk > T.OOM_RISK_RATIO
    report.add(
        "warn" if high else "ok",
        "memory",
        cgroup.cgroup,
        text,
        "raise the memory limit or free shm" if high else "",
    )
    kills = next(
        (c.kills for c in model.oom_kills if c.cgroup == cgroup.cgroup),
        cgroup.oom_kills,
    )
    if kills:
        report.add(
            "warn",
            "memory",
            cgroup.cgroup,
            f"{kills} OOM kill(s) so far",
            "count /dev/shm in the memory budget",
        )
    for view in model.mounts:
        budget = view.budget
        if (
            view.cgroup is cgroup
            and budget is not None
            and budget.projection is not None
            and budget.projection > T.SHM_OOM_PROJECTION_RATIO
        ):
            report.add(
                "warn",
                "memory",
                view.mount,
                f"filling it ({human(budget.fillable_bytes)}) would need "
                f"{budget.projection:.0%} of the memory limit: the pod is OOM-killed before tmpfs says ENOSPC",
                f"lower sizeLimit to at most {human(budget.room_bytes)} or raise the memory limit",
            )


def _pod_memory(report: Report, pods, kills: Dict[str, int]) -> None:
    report.facts["pod_cgroups"] = [asdict(c) for c in pods]
    risky = 0
    for c in pods:
        if c.oom_risk_ratio is not None and c.oom_risk_ratio > T.OOM_RISK_RATIO:
            risky += 1
            report.add(
                "warn",
                "memory",
                f"pod {c.pod_uid}",
                f"working set {human(c.working_set_bytes)} of "
                f"{human(c.limit_bytes)} limit ({c.working_set_bytes / c.limit_bytes:.0%})",
                "raise the pod's memory limit or free its shm",
            )
        if kills.get(c.cgroup):
            report.add(
                "warn",
                "memory",
                f"pod {c.pod_uid}",
                f"{kills[c.cgroup]} OOM kill(s) so far",
                "count /dev/shm in the memory budget",
            )
    if not risky:
        report.add(
            "ok",
            "memory",
            "pods",
            f"{len(pods)} pod cgroup(s), none above "
            f"{T.OOM_RISK_RATIO:.0%} of its limit",
        )


# --- output -----------------------------------------------------------------------------------
def render_text(report: Report) -> str:
    findings = report.sorted()
    lines = [
        f"shmwatch check {__version__}: {len([f for f in findings if f.severity in ('fail', 'warn')])} "
        f"problem(s), worst first",
        "",
        f"{'STATUS':<7}{'AREA':<8}{'SUBJECT':<28}WHAT",
    ]
    for f in findings:
        lines.append(
            f"{f.severity.upper():<7}{f.area:<8}{f.subject[:27]:<28}{f.message}"
        )
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
        "recommendations": report.facts.get("recommendations", []),  # --recommend
        "recommendation_notes": report.facts.get("recommendation_notes", []),
        "oom_kills": report.facts.get("oom_kills", []),
        "sysv_namespaces": report.facts.get("sysv_namespaces", []),
    }
    return json.dumps(doc, indent=2, default=str) + "\n"


def main(argv: Sequence[str]) -> int:
    parser = build_parser(prog="shmwatch check")
    parser.usage_exit_code = EXIT_USAGE
    parser.add_argument(
        "--require-shm",
        type=typed(parse_size, "--require-shm"),
        default=None,
        help="Fail (exit 2) when the shm mount can hold less than this, e.g. 16Gi.",
    )
    parser.add_argument(
        "--backend",
        choices=sorted(BACKEND_SHM),
        default=None,
        help="Warn when shm is below what this serving engine needs (vllm/sglang 16Gi, trtllm 80Gi).",
    )
    parser.add_argument("--output", choices=("text", "json"), default="text")
    parser.add_argument(
        "--log",
        action="append",
        default=[],
        metavar="FILE",
        help="Scan a server log for known shared-memory and OOM failure signatures (repeatable).",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="Seconds to wait for all collectors.",
    )
    R.add_arguments(parser, typed)
    cfg, extra = parse_args(list(argv), parser=parser)
    import logging

    logging.basicConfig(
        level=logging.CRITICAL
    )  # failures are in the report, not on stderr
    for path in extra.log:
        if not os.access(path, os.R_OK):
            sys.stderr.write(
                f"shmwatch check: error: argument --log: cannot read {path}\n"
            )
            return EXIT_USAGE
    from exporter.app import App

    app = App(
        cfg, kmsg_from_start=True
    )  # recent kills: the kernel log ring from its start
    # One run of every source (each on its own thread, so a hung GPU is bounded by its
    # timeout), then the model, then the report. No inotify: nothing here waits for events.
    try:
        app.discovery.collect()
    except (OSError, ValueError):
        pass  # reported by the discovery source's own run
    app.sampler.start()
    timeout = (
        extra.timeout
        if extra.timeout is not None
        else max(cfg.gpu_timeout, cfg.collector_timeout) + 1
    )
    app.sampler.wait_for_first_run(timeout)
    model = app.step.current()
    app.sampler.stopping.set()
    stuck = set(app.sampler.stuck())
    for source in app.sources:
        close = getattr(source, "close", None)
        if close and source.name not in stuck:
            close()
    required, required_by = extra.require_shm, "--require-shm"
    log_hits: Dict[str, List[LogHit]] = {}
    for path in extra.log:
        for name, hits in scan_log(path).items():
            log_hits.setdefault(name, []).extend(hits)
    report = diagnose(model, cfg, required, required_by, log_hits)
    if extra.backend:
        need = BACKEND_SHM[extra.backend]
        for facts in report.facts.get("shm", []):
            if facts["effective_size_bytes"] < need and not (
                required and required >= need
            ):
                report.add(
                    "warn",
                    "shm",
                    facts["mount"],
                    f"can hold {human(facts['effective_size_bytes'])}, under the {human(need)} recommended "
                    f"for {extra.backend}",
                    shm_remedy(need),
                )
    recs: List[R.Recommendation] = []
    if extra.recommend:
        recs, notes = R.recommendations(model, extra)
        for r in recs:
            if r.memory_limit_fits is False:
                report.add(
                    "warn",
                    "memory",
                    r.mount,
                    f"the recommended {human(r.recommended_size_bytes)} of shm does "
                    f"not fit in what the {human(r.memory_limit_bytes)} memory limit leaves",
                    f"raise the memory limit to {human(r.memory_limit_bytes_needed)}, then the shm size",
                )
        report.facts["recommendations"] = [asdict(r) for r in recs]
        report.facts["recommendation_notes"] = notes
    if extra.output == "json":
        sys.stdout.write(render_json(report))
    else:
        sys.stdout.write(render_text(report))
        if extra.recommend:
            sys.stdout.write(R.render_text(recs, notes, extra.recommend_headroom))
    return report.exit_code
