"""`shmwatch check`: runs every collector once and prints what is wrong, worst first, each
problem with its remedy (GPU, shm mounts, memory, SysV, server logs); exit codes: findings.py."""

import argparse
import logging
import math
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from exporter.check import recommend as R
from exporter.check import thresholds as T
from exporter.check.findings import EXIT_SOFTWARE, EXIT_USAGE, MAX_NAMED, Bounded
from exporter.check.findings import Report, at_least, at_most, human, left, plausible
from exporter.check.findings import quantities, render_json, render_text, round_up
from exporter.check.kernel import memory, oom_kills, outside, sysv
from exporter.check.logscan import LogScan, log_findings, refusal, scan_log
from exporter.check.names import Links, Names, leaked_names, shell, shown
from exporter.host.paths import Paths
from exporter.config import Config, build_parser, parse_args, parse_size, typed
from exporter.model.classes import NOT_LEAKS, REMOVABLE, classify
from exporter.model.step import Model, MountView
from exporter.model.summary import SegmentSummary
from exporter.model.types import MountUsage, Segment

# Recommended shm per backend. vLLM's and SGLang's docs name no number: 16Gi holds NCCL's
# segments, the engines' shm queues and multimodal caches in tensor-parallel serving;
# TensorRT-LLM, with its own shm-based IPC, gets 80Gi (NVIDIA's large-model examples go higher).
BACKEND_SHM = {"vllm": 16 << 30, "sglang": 16 << 30, "trtllm": 80 << 30}
READS_SECONDS = 10.0  # no --timeout: Prometheus and exporter reads after the collectors
# A failed source warns in its area (else shm). gpu, cgroup, oom failures: info with own
# findings (no driver or readable cgroup is normal); "process" (our own metrics): none.
FAILURE_AREAS = {"sysv": "sysv", "host_memory": "memory"}
QUIET_FAILURES = ("gpu", "cgroup", "process", "oom")
USAGE = "shmwatch check: error: argument --log: "
MOUNT_FACTS = ("mount", "fstype", "size_bytes", "used_bytes", "available_bytes")
REMOUNT = "mount the workload's shm volume at this path"
CLEAN_UP = "remove leaked segments"
TMPFS = "mount a tmpfs (or memory emptyDir) here"
LIMIT_UNKNOWN = (
    "let shmwatch read the workload's memory cgroup, or give it the limit: "
    "--memory.limit-bytes from the Downward API's limits.memory"
)
HIDDEN_BY = "NCCL >= 2.19, UCX proc link, torch file_descriptor"
LEAKED = "{count} leaked segment(s) held by no process, {size}: {paths}"
RM = "once no server can attach to them{notes}: {rm}"  # the command last: a line to paste
FOREIGN = "{count} file(s) of no known owner class held by no process, {size}: {paths}"
NO_RM = "find which tool made them before removing anything (a container engine's lock file is one)"
UNVERIFIED = (
    "{count} segment(s), {size}, held by no process shmwatch could inspect (could not read "
    "{unreadable}): not called leaked, they may be live"
)
MAY_BE_LIVE = (
    "to tell live from leaked, run shmwatch as the server's UID or with CAP_SYS_PTRACE "
    "(README: Deploy); never remove them on this report's word"
)


@dataclass(frozen=True)
class CheckFlags:
    """check's own flags (the exporter's are config.py's)."""

    require_shm: Optional[int]
    backend: Optional[str]
    output: str
    log: List[str]
    timeout: Optional[float]
    recommend: bool
    prometheus_url: Optional[str]
    prometheus_selector: str
    exporter_url: Optional[str]
    recommend_window: str
    recommend_headroom: float


def _seconds(text: str) -> float:
    seconds = float(text)
    if not 0 < seconds < math.inf:
        raise ValueError(f"not a number of seconds above 0: {text!r}")
    return seconds


def _size(text: str) -> int:
    return plausible(parse_size(text))


def check_parser() -> argparse.ArgumentParser:
    """The exporter's flags and check's own; a type's ValueError names the flag."""
    parser = build_parser(prog="shmwatch check")
    add = parser.add_argument
    add(
        "--require-shm",
        dest="require_shm",
        type=typed(_size),
        help="Fail (exit 2) when the shm mount can hold less than this, e.g. 16Gi.",
    )
    add(
        "--backend",
        dest="backend",
        choices=sorted(BACKEND_SHM),
        help="Warn when shm is below what this serving engine needs (vllm/sglang 16Gi, trtllm 80Gi).",
    )
    add("--output", dest="output", choices=("text", "json"), default="text")
    add(
        "--log",
        dest="log",
        action="append",
        default=[],
        metavar="FILE",
        help="Scan a server log for known shared-memory and OOM failure signatures (repeatable).",
    )
    add(
        "--timeout",
        dest="timeout",
        type=typed(_seconds),
        help="Seconds the whole check may take: collectors, logs, Prometheus and exporter reads.",
    )
    add(
        "--recommend",
        dest="recommend",
        action="store_true",
        help="Recommend a shm size per mount from the observed peak, with the settings to apply.",
    )
    _add_recommend_flags(parser)
    return parser


def _add_recommend_flags(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--prometheus.url",
        dest="prometheus_url",
        metavar="URL",
        type=typed(R.parse_url),
        help="Prometheus to read the peak over --recommend.window from (HTTP API /api/v1/query).",
    )
    add(
        "--prometheus.selector",
        dest="prometheus_selector",
        metavar="MATCHERS",
        default="",
        help='Label matchers that pick this workload\'s series, e.g. instance="10.0.0.5:9841".',
    )
    add(
        "--exporter.url",
        dest="exporter_url",
        metavar="URL",
        type=typed(R.parse_url),
        help="A running shmwatch's /metrics: its high-water mark, when Prometheus has none.",
    )
    add(
        "--recommend.window",
        dest="recommend_window",
        default=R.DEFAULT_WINDOW,
        type=typed(R.parse_window),
        help="How far back to look in Prometheus.",
    )
    add(
        "--recommend.headroom",
        dest="recommend_headroom",
        default=R.DEFAULT_HEADROOM,
        type=typed(R.parse_headroom),
        help="Factor on top of the peak.",
    )


def shm_remedy(required: int) -> str:
    """How to get a mount that holds `required` bytes, in the size recommendations round to."""
    docker, k8s = quantities(round_up(required))
    return (
        f"docker run --shm-size={docker} (or --ipc=host); compose shm_size: {docker}b; "
        f"Kubernetes: an emptyDir {{medium: Memory, sizeLimit: {k8s}}} mounted at /dev/shm"
    )


@dataclass(frozen=True)
class MountFindings:
    """Findings about one mount: into the report, under the mount's name."""

    report: Report
    subject: str  # the mount, shown

    def add(self, severity: str, message: str, remedy: str = "") -> None:
        self.report.add(severity, "shm", self.subject, message, remedy)

    def any_problem(self) -> bool:
        return any(
            f.severity in ("fail", "warn") and f.subject == self.subject
            for f in self.report.findings
        )


@dataclass(frozen=True)
class _Unheld:
    """One kind of finding about segments held by no process."""

    state: str  # orphan | unverified
    classes: Set[str]
    segments: List[Segment]  # the summary's listed ones, largest first
    severity: str
    text: str  # LEAKED, FOREIGN, UNVERIFIED
    remedy: str  # RM, NO_RM, MAY_BE_LIVE


def shm(
    report: Report,
    view: MountView,
    model: Model,
    required: Optional[int],
    links: Links = None,
) -> None:
    """A mount's size, fullness, filesystem and segments. `view` has usage; `links`:
    names.leaked_names's (without: each leaked file by the name it was listed)."""
    m = view.usage
    assert m is not None  # diagnose passes the mounts measured
    findings = MountFindings(report=report, subject=shown(m.mount))
    must = "fail" if required else "warn"  # what a required mount's trouble is
    if m.error:
        findings.add(must, f"cannot be measured: {shown(m.error)}", REMOUNT)
        return
    assert view.budget is not None  # a mount measured has its budget
    # Without the memory limit, what the mount can hold is at most its size: no more is
    # known, so the JSON leaves the effective size out (as /metrics does) and a requirement
    # the size alone meets is not called met.
    effective = view.budget.effective_bytes
    usage = _usage_line(m)
    facts: Dict[str, Any] = {name: getattr(m, name) for name in MOUNT_FACTS}
    facts["effective_size_bytes"] = effective if view.budget_complete else None
    report.facts.setdefault("shm", []).append(facts)
    _size_findings(findings, m, usage, effective, required)
    if required and effective >= required and not view.budget_complete:
        wanted = f"the {at_least(required)} required"
        findings.add(
            "warn", f"{usage}: {_limit_unknown(effective, wanted)}", LIMIT_UNKNOWN
        )
    _fullness_findings(findings, m, usage, must)
    if m.fstype != "tmpfs":
        findings.add("warn", f"is {shown(m.fstype)}, not tmpfs", TMPFS)
    problem = findings.any_problem()
    inv, summary = view.inventory, view.summary
    if inv is None or inv.error or summary is None:
        if not problem:
            findings.add("ok", usage)
        return
    facts.update(_segment_facts(summary, model))
    facts["unattributed_bytes"] = inv.unattributed_bytes
    if not problem:
        findings.add("ok", usage + _by_class(summary))
    _segment_findings(findings, m.mount, summary, model, links)


def _limit_unknown(size: int, wanted: str) -> str:
    """`wanted`: 'the 16.0 GiB required', 'the 16.0 GiB recommended for vllm'."""
    return (
        f"its size, {at_most(size)}, meets {wanted}, but the memory limit its pages "
        "are charged to could not be read: it may hold less"
    )


def _usage_line(m: MountUsage) -> str:
    """'64.0 MiB (Docker's 64 MiB default), 1.0 MiB used (2%)'."""
    size, default = human(m.size_bytes), T.DOCKER_DEFAULT_SHM_BYTES
    if m.size_bytes <= default:
        below = "" if m.size_bytes == default else "below "
        size += f" ({below}Docker's 64 MiB default)"
    return f"{size}, {human(m.used_bytes)} used ({m.usage_ratio:.0%})"


def _size_findings(
    findings: MountFindings,
    m: MountUsage,
    usage: str,
    effective: int,
    required: Optional[int],
) -> None:
    """Below --require-shm (what it can hold, not its tmpfs size), or at Docker's default."""
    if required and effective < required:
        held = f"can hold {at_most(effective)}, below the {at_least(required)} required"
        findings.add("fail", f"{usage}: {held} (--require-shm)", shm_remedy(required))
    elif m.size_bytes <= T.DOCKER_DEFAULT_SHM_BYTES:
        small = f"{usage}: far too small for NCCL, torch or vLLM"
        findings.add("warn", small, shm_remedy(16 << 30))


def _fullness_findings(
    findings: MountFindings, m: MountUsage, usage: str, must: str
) -> None:
    if m.usage_ratio > T.SHM_USAGE_CRITICAL_RATIO:
        findings.add(
            must, f"{usage}: about to be full", f"{CLEAN_UP} (below) or raise the size"
        )
    elif m.usage_ratio > T.SHM_USAGE_WARNING_RATIO:
        above = f"above {T.SHM_USAGE_WARNING_RATIO * 100:g} %"
        findings.add("warn", f"{usage}: {above}", f"{CLEAN_UP} or raise the size")


def _listed(s: Segment) -> Dict[str, Any]:
    return {"name": s.name, "class": s.cls, "bytes": s.allocated_bytes}


def _segment_facts(summary: SegmentSummary, model: Model) -> Dict[str, Any]:
    assert model.inventory is not None  # a mount's summary comes with the inventory
    wall = model.inventory.wall_time
    return dict(
        bytes_by_class=dict(summary.bytes_by_class),
        orphans=[
            dict(_listed(s), age_seconds=max(0, int(wall - s.mtime)))
            for s in summary.leaked
        ],
        unverified=[_listed(s) for s in summary.unverified],
        hidden_bytes=summary.hidden_bytes,
        segments=sum(t.count for t in summary.totals.values()),
    )


def _by_class(summary: SegmentSummary) -> str:
    """'; by class: nccl 4.0 MiB, torch 1.0 MiB', largest first; '' when none holds a byte."""
    by_class = sorted(summary.bytes_by_class.items(), key=lambda kv: -kv[1])
    classes = ", ".join(f"{c} {human(b)}" for c, b in by_class if b)
    return f"; by class: {classes}" if classes else ""


def _segment_findings(
    findings: MountFindings,
    mount: str,
    summary: SegmentSummary,
    model: Model,
    links: Links,
) -> None:
    """Segments held by no process, and those hidden. `rm` is advised only where nothing can
    still attach: an orphan (every process inspected) of a class whose segments belong to
    one process."""
    assert model.inventory is not None
    inventory = model.inventory
    unreadable = _unreadable(inventory.proc_unreadable, inventory.unproven)
    leaks = {c for c, _ in summary.totals} - NOT_LEAKS
    kinds = (
        _Unheld(
            state="orphan",
            classes=leaks & REMOVABLE,
            segments=summary.leaked,
            severity="warn",
            text=LEAKED,
            remedy=RM,
        ),
        _Unheld(
            state="orphan",
            classes=leaks - REMOVABLE,
            segments=summary.leaked,
            severity="info",
            text=FOREIGN,
            remedy=NO_RM,
        ),
        _Unheld(
            state="unverified",
            classes=leaks,
            segments=summary.unverified,
            severity="info",
            text=UNVERIFIED,
            remedy=MAY_BE_LIVE,
        ),
    )
    for kind in kinds:
        _unheld_finding(findings, mount, summary, kind, unreadable, links)
    if summary.hidden_count:
        hidden = f"{summary.hidden_count} unlinked-but-mapped segment(s), {human(summary.hidden_bytes)}"
        findings.add("info", f"{hidden}: counted by df, invisible to ls ({HIDDEN_BY})")


def _unheld_finding(
    findings: MountFindings,
    mount: str,
    summary: SegmentSummary,
    kind: _Unheld,
    unreadable: str,
    links: Links,
) -> None:
    rows = [
        v
        for (c, s), v in summary.totals.items()
        if s == kind.state and c in kind.classes
    ]
    count = sum(r.count for r in rows)
    total = sum(r.allocated_bytes for r in rows)
    if not count:
        return
    named = [s for s in kind.segments if s.cls in kind.classes][:MAX_NAMED]
    paths = " ".join(shown(os.path.join(mount, s.name)) for s in named)
    if count > len(named):
        paths += f" (+{count - len(named)} more)"
    said = dict(count=count, size=human(total), paths=paths, unreadable=unreadable)
    rm = _removal(mount, named, links) if kind.remedy == RM else ""
    findings.add(
        kind.severity, kind.text.format(**said), rm or kind.remedy.format(**said)
    )


def _removal(mount: str, named: List[Segment], links: Links) -> str:
    """RM for the named leaked files, each by every name it has (one of several frees
    nothing), and notes on those left out (_kept)."""
    args: List[str] = []
    notes: List[str] = []
    listed = links or {}  # not looked up: each file by the name it was listed
    for seg in named:
        names = listed.get(seg.key, Names(found=(seg.name,), links=1))
        path, note = shown(os.path.join(mount, seg.name)), _kept(mount, names)
        if not note:
            args += [os.path.join(mount, n) for n in names.found]
        if note or names.links > 1:
            notes.append(f"{path} {note or f'has {names.links} names, all removed'}")
    if not args:
        return "; ".join(notes)
    notes_said = f" ({'; '.join(notes)})" if notes else ""
    return RM.format(notes=notes_said, rm=shell("rm", "--", *args))


def _kept(mount: str, names: Names) -> str:
    """Why a leaked file is not advised away, or '': gone or replaced since it was listed, a
    name not found below the mount (removing the others frees nothing), or of another class."""
    other = [n for n in names.found if classify(os.path.basename(n)) not in REMOVABLE]
    if not names.links:
        return "is gone or another file since listed"
    if len(names.found) < names.links:
        missing = f"{names.links - len(names.found)} not found below {shown(mount)}"
        return f"has {names.links} names, {missing}: removing the others frees nothing"
    return f"is also {shown(other[0])}, of no class shmwatch removes" if other else ""


def _unreadable(count: Optional[int], unproven: List[str]) -> str:
    """'3 process(es): python3 (pid 7, uid 0); ...': how many, and the first few by name."""
    named = "; ".join(map(shown, unproven[:MAX_NAMED]))
    if count is None:
        # the reasons say what could not be counted (hidepid, a PID namespace of its own)
        return named or "processes hidden from shmwatch, uncounted"
    more = " and more" if len(unproven) > MAX_NAMED or count > len(unproven) else ""
    return f"{count} process(es): {named}{more}" if named else f"{count} process(es)"


def diagnose(
    model: Model,
    required: Optional[int] = None,
    backend: Optional[str] = None,
    links: Links = None,
) -> Report:
    """The report, from the model alone: no totals, thresholds or class rules of its own.
    `required`: --require-shm's bytes; `links`: names.leaked_names's."""
    report, failed = Report(), [s for s in model.statuses if not s.success]
    errors = {s.name: shown(s.error or "no answer within --timeout") for s in failed}
    _gpu_findings(report, model, errors.get("gpu"))
    for view in model.mounts:
        if view.usage is not None:
            shm(report, view, model, required, links)
    memory(report, model, errors.get("cgroup"))
    oom_kills(report, model, errors.get("oom"))
    sysv(report, model.sysv, model.node_mode)
    for name, error in errors.items():
        if name not in QUIET_FAILURES:
            area = FAILURE_AREAS.get(name, "shm")
            report.add("warn", area, f"collector {name}", f"could not be read: {error}")
    _backend_findings(report, required, backend)
    return report


def _gpu_findings(report: Report, model: Model, error: Optional[str]) -> None:
    """Each GPU's memory, nearly full or not, and the GPUs NVML skipped."""
    devices = model.gpu.devices if model.gpu else []
    if model.gpu is None and error is not None:
        report.add("info", "gpu", "NVML", f"GPU memory not checked: {error}")
    report.facts["gpus"] = [asdict(d) for d in devices]
    for d in devices:
        ratio = d.used_bytes / d.total_bytes if d.total_bytes else 0
        text = f"{human(d.used_bytes)} of {human(d.total_bytes)} used ({ratio:.0%})"
        subject = shown(f"GPU {d.gpu} {d.name}")
        if ratio > T.GPU_MEMORY_FULL_RATIO:
            remedy = "lower --gpu-memory-utilization or stop the other GPU processes"
            report.add("warn", "gpu", subject, text + ": less than 2 % free", remedy)
        else:
            report.add("ok", "gpu", subject, text)
    for skipped in model.gpu.errors if model.gpu else []:
        text = f"GPU skipped: {shown(skipped)}"
        report.add("warn", "gpu", "NVML", text, "nvidia-smi; dmesg | grep -i xid")


def _backend_findings(
    report: Report, required: Optional[int], backend: Optional[str]
) -> None:
    """A mount that can hold less than this project recommends for `backend` (unless
    --require-shm asks as much or more, which judged it already)."""
    if backend is None or backend not in BACKEND_SHM:
        return
    need = BACKEND_SHM[backend]
    for facts in report.facts.get("shm", []):
        # Without the memory limit: judged by its size, what it can hold at most.
        effective = facts["effective_size_bytes"]
        known = effective is not None
        if not known:
            effective = facts["size_bytes"]
        if required and required >= need:
            continue
        mount = shown(facts["mount"])
        if effective < need:
            text = f"can hold {human(effective)}, under the {human(need)} recommended for {backend}"
            report.add("warn", "shm", mount, text, shm_remedy(need))
        elif not known:
            wanted = f"the {human(need)} recommended for {backend}"
            report.add(
                "warn", "shm", mount, _limit_unknown(effective, wanted), LIMIT_UNKNOWN
            )


def names_by(model: Model, paths: Paths, deadline: float) -> Links:
    """names.leaked_names by `deadline`; a mount that does not answer: files as listed."""
    try:
        return Bounded(partial(leaked_names, model, paths, deadline)).result(deadline)
    except (TimeoutError, OSError):
        return None


def main(argv: Sequence[str], collect: Callable[[Config, float], Model]) -> int:
    """`collect(cfg, timeout)`: one run of every source, and the model made of it."""
    try:
        return _check(argv, collect)
    except Exception as err:
        traceback.print_exc()
        name = type(err).__name__
        sys.stderr.write(f"shmwatch check: internal error ({name}), please report it\n")
        return EXIT_SOFTWARE


def _check(argv: Sequence[str], collect: Callable[[Config, float], Model]) -> int:
    started = time.monotonic()
    cfg, flags = _parse(argv)
    logging.basicConfig(level=logging.CRITICAL)  # failures are in the report
    collectors = max(cfg.gpu_timeout, cfg.collector_timeout) + 1
    timeout = flags.timeout or collectors + READS_SECONDS
    deadline = started + timeout
    refused = _refused_log(flags.log, started + timeout / 4)
    if refused:
        sys.stderr.write(refused)
        return EXIT_USAGE
    model = collect(cfg, min(collectors, left(deadline)))
    # Logs after collecting: matching holds the GIL; collectors would time out
    until = deadline - timeout / 10  # early enough to be reported
    scans: List[Tuple[str, Bounded[LogScan]]] = [
        (path, Bounded(partial(scan_log, path, until))) for path in flags.log
    ]
    paths = Paths(procfs=cfg.procfs, sysfs=cfg.sysfs, rootfs=cfg.rootfs)
    links = names_by(model, paths, until)
    report = diagnose(model, flags.require_shm, flags.backend, links)
    # before the logs: one on a hung filesystem is awaited until the deadline
    outside(report, model, paths, deadline)
    log_findings(report, scans, deadline)
    _limit_flag_finding(report, model, cfg.memory_limit_bytes)
    advice = R.advise(report, model, flags, deadline) if flags.recommend else ""
    _write(report, advice, flags.output == "json")
    return report.exit_code


def _parse(argv: Sequence[str]) -> Tuple[Config, CheckFlags]:
    """The exporter's configuration and check's flags; a usage error exits EXIT_USAGE."""
    try:
        cfg, extra = parse_args(list(argv), parser=check_parser())
    except SystemExit as err:
        # argparse and a bad flag value exit 2, which here means "a requirement failed"
        raise SystemExit(EXIT_USAGE if err.code == 2 else err.code) from None
    flags = CheckFlags(
        require_shm=extra.require_shm,
        backend=extra.backend,
        output=extra.output,
        log=extra.log,
        timeout=extra.timeout,
        recommend=extra.recommend,
        prometheus_url=extra.prometheus_url,
        prometheus_selector=extra.prometheus_selector,
        exporter_url=extra.exporter_url,
        recommend_window=extra.recommend_window,
        recommend_headroom=extra.recommend_headroom,
    )
    return cfg, flags


def _refused_log(logs: List[str], by: float) -> str:
    """The usage error for the first --log that is not a readable regular file, or ''. A
    path on a hung filesystem does not answer stat() either: its scan will say so."""
    checks = [(path, Bounded(partial(refusal, path))) for path in logs]
    for path, check in checks:
        try:
            problem = check.result(by)
        except TimeoutError:
            continue
        if problem:
            return f"{USAGE}{shown(path)}: {problem}\n"
    return ""


def _limit_flag_finding(report: Report, model: Model, flag: Optional[int]) -> None:
    """--memory.limit-bytes at or above the host's memory: taken as no limit (usable_limit_flag)."""
    host = model.host_memory
    if host is not None and flag is not None and flag >= host.total_bytes:
        text = (
            f"{human(flag)} is at or above the host's memory: taken as no limit given"
        )
        remedy = "a container without a memory limit gets the node's memory from the Downward API"
        report.add("warn", "memory", "--memory.limit-bytes", text, remedy)


def _write(report: Report, advice: str, json: bool) -> None:
    if hasattr(sys.stdout, "reconfigure"):  # a character it cannot encode: \uXXXX
        sys.stdout.reconfigure(errors="backslashreplace")
    sys.stdout.write(render_json(report) if json else render_text(report) + advice)
