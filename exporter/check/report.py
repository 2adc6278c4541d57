"""`shmwatch check`: runs every collector once and prints what is wrong, worst first, each
problem with its remedy (GPU, shm mounts, memory, SysV, server logs); exit codes: findings.py."""

import logging
import math
import os
import sys
import time
import traceback
from dataclasses import asdict
from typing import Callable, List, Optional, Sequence

from exporter.check import recommend as R
from exporter.check import thresholds as T
from exporter.check.findings import EXIT_SOFTWARE, EXIT_USAGE, MAX_NAMED, Bounded
from exporter.check.findings import Report, at_least, at_most, human, left, plausible
from exporter.check.findings import quantities, render_json, render_text, round_up
from exporter.check.kernel import memory, oom_kills, outside, sysv
from exporter.check.logscan import log_findings, refusal, scan_log
from exporter.check.names import Links, Names, leaked_names, shell, shown
from exporter.host.paths import Paths
from exporter.config import Config, build_parser, parse_args, parse_size, typed
from exporter.model.classes import NOT_LEAKS, REMOVABLE, classify
from exporter.model.step import Model, MountView
from exporter.model.types import GpuSnapshot, Segment

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


def _seconds(text: str) -> float:
    seconds = float(text)
    if not 0 < seconds < math.inf:
        raise ValueError(f"not a number of seconds above 0: {text!r}")
    return seconds


# check's own flags (the exporter's: config.py); a type's ValueError names the flag
FLAGS = {
    "--require-shm": dict(type=lambda text: plausible(parse_size(text))),
    "--backend": dict(choices=sorted(BACKEND_SHM)),
    "--output": dict(choices=("text", "json"), default="text"),
    "--log": dict(action="append", default=[], metavar="FILE"),
    "--timeout": dict(type=_seconds),
    "--recommend": dict(action="store_true"),
    "--prometheus.url": dict(metavar="URL", type=R.parse_url),
    "--prometheus.selector": dict(metavar="MATCHERS", default=""),
    "--exporter.url": dict(metavar="URL", type=R.parse_url),
    "--recommend.window": dict(default=R.DEFAULT_WINDOW, type=R.parse_window),
    "--recommend.headroom": dict(default=R.DEFAULT_HEADROOM, type=R.parse_headroom),
}
HELP = {
    "--require-shm": "Fail (exit 2) when the shm mount can hold less than this, e.g. 16Gi.",
    "--backend": "Warn when shm is below what this serving engine needs (vllm/sglang 16Gi, trtllm 80Gi).",
    "--log": "Scan a server log for known shared-memory and OOM failure signatures (repeatable).",
    "--timeout": "Seconds the whole check may take: collectors, logs, Prometheus and exporter reads.",
    "--recommend": "Recommend a shm size per mount from the observed peak, with the settings to apply.",
    "--prometheus.url": "Prometheus to read the peak over --recommend.window from (HTTP API /api/v1/query).",
    "--prometheus.selector": 'Label matchers that pick this workload\'s series, e.g. instance="10.0.0.5:9841".',
    "--exporter.url": "A running shmwatch's /metrics: its high-water mark, when Prometheus has none.",
    "--recommend.window": "How far back to look in Prometheus.",
    "--recommend.headroom": "Factor on top of the peak.",
}


def shm_remedy(required: int) -> str:
    """How to get a mount that holds `required` bytes, in the size recommendations round to."""
    docker, k8s = quantities(round_up(required))
    return (
        f"docker run --shm-size={docker} (or --ipc=host); compose shm_size: {docker}b; "
        f"Kubernetes: an emptyDir {{medium: Memory, sizeLimit: {k8s}}} mounted at /dev/shm"
    )


def shm(
    report: Report,
    view: MountView,
    model: Model,
    required: Optional[int],
    links: Links = None,
) -> None:
    """`links`: names.leaked_names's (without: each leaked file by the name it was listed)."""
    m, mount = view.usage, view.usage.mount

    def add(severity: str, message: str, remedy: str = "") -> None:
        report.add(severity, "shm", shown(mount), message, remedy)

    must = "fail" if required else "warn"  # what a required mount's trouble is
    if m.error:
        add(must, f"cannot be measured: {shown(m.error)}", REMOUNT)
        return
    effective, default = view.budget.effective_bytes, T.DOCKER_DEFAULT_SHM_BYTES
    size = human(m.size_bytes)
    if m.size_bytes <= default:
        below = "" if m.size_bytes == default else "below "
        size += f" ({below}Docker's 64 MiB default)"
    usage = f"{size}, {human(m.used_bytes)} used ({m.usage_ratio:.0%})"
    facts = {name: getattr(m, name) for name in MOUNT_FACTS}
    facts["effective_size_bytes"] = effective
    report.facts.setdefault("shm", []).append(facts)
    if required and effective < required:
        held = f"can hold {at_most(effective)}, below the {at_least(required)} required"
        add("fail", f"{usage}: {held} (--require-shm)", shm_remedy(required))
    elif m.size_bytes <= default:
        small = f"{usage}: far too small for NCCL, torch or vLLM"
        add("warn", small, shm_remedy(16 << 30))
    if m.usage_ratio > T.SHM_USAGE_CRITICAL_RATIO:
        add(must, f"{usage}: about to be full", f"{CLEAN_UP} (below) or raise the size")
    elif m.usage_ratio > T.SHM_USAGE_WARNING_RATIO:
        above = f"above {T.SHM_USAGE_WARNING_RATIO * 100:g} %"
        add("warn", f"{usage}: {above}", f"{CLEAN_UP} or raise the size")
    if m.fstype != "tmpfs":
        add("warn", f"is {shown(m.fstype)}, not tmpfs", TMPFS)
    problems = [f for f in report.findings if f.severity in ("fail", "warn")]
    problem = any(f.subject == shown(mount) for f in problems)
    inv, summary = view.inventory, view.summary
    if inv is None or inv.error or summary is None:
        if not problem:
            add("ok", usage)
        return

    def listed(s) -> dict:
        return {"name": s.name, "class": s.cls, "bytes": s.allocated_bytes}

    wall = model.inventory.wall_time
    facts.update(
        bytes_by_class=dict(summary.bytes_by_class),
        orphans=[
            dict(listed(s), age_seconds=max(0, int(wall - s.mtime)))
            for s in summary.leaked
        ],
        unverified=[listed(s) for s in summary.unverified],
        hidden_bytes=summary.hidden_bytes,
        segments=sum(n for n, _, _ in summary.totals.values()),
        unattributed_bytes=inv.unattributed_bytes,
    )
    if not problem:
        by_class = sorted(summary.bytes_by_class.items(), key=lambda kv: -kv[1])
        classes = ", ".join(f"{c} {human(b)}" for c, b in by_class if b)
        add("ok", usage + (f"; by class: {classes}" if classes else ""))
    # Segments held by no process. `rm` is advised only where nothing can still attach: an
    # orphan (every process inspected) of a class whose segments belong to one process.
    unreadable = _unreadable(model.inventory.proc_unreadable, model.inventory.unproven)
    totals = summary.totals.items()
    leaks = {c for c, _ in summary.totals} - NOT_LEAKS
    for state, classes, segments, severity, text, remedy in (
        ("orphan", leaks & REMOVABLE, summary.leaked, "warn", LEAKED, RM),
        ("orphan", leaks - REMOVABLE, summary.leaked, "info", FOREIGN, NO_RM),
        ("unverified", leaks, summary.unverified, "info", UNVERIFIED, MAY_BE_LIVE),
    ):
        rows = [v for (c, s), v in totals if s == state and c in classes]
        count, total = sum(r[0] for r in rows), sum(r[1] for r in rows)
        if not count:
            continue
        named = [s for s in segments if s.cls in classes][:MAX_NAMED]
        paths = " ".join(shown(os.path.join(mount, s.name)) for s in named)
        if count > len(named):
            paths += f" (+{count - len(named)} more)"
        said = dict(count=count, size=human(total), paths=paths, unreadable=unreadable)
        rm = _removal(mount, named, links) if remedy is RM else ""
        add(severity, text.format(**said), rm or remedy.format(**said))
    if summary.hidden_count:
        hidden = f"{summary.hidden_count} unlinked-but-mapped segment(s), {human(summary.hidden_bytes)}"
        add("info", f"{hidden}: counted by df, invisible to ls ({HIDDEN_BY})")


def _removal(mount: str, named: List[Segment], links: Links) -> str:
    """RM for the named leaked files, each by every name it has (one of several frees
    nothing), and notes on those left out (_kept)."""
    args: List[str] = []
    notes: List[str] = []
    listed = links or {}  # not looked up: each file by the name it was listed
    for seg in named:
        names = listed.get(seg.key, Names((seg.name,), 1))
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


def diagnose(model: Model, required=None, backend=None, links: Links = None) -> Report:
    """The report, from the model alone: no totals, thresholds or class rules of its own.
    `required`: --require-shm's bytes; `links`: names.leaked_names's."""
    report, failed = Report(), [s for s in model.statuses if not s.success]
    errors = {s.name: shown(s.error or "no answer within --timeout") for s in failed}
    gpus = model.gpu or GpuSnapshot("", [])
    if model.gpu is None and "gpu" in errors:
        report.add("info", "gpu", "NVML", f"GPU memory not checked: {errors['gpu']}")
    report.facts["gpus"] = [asdict(d) for d in gpus.devices]
    for d in gpus.devices:
        ratio = d.used_bytes / d.total_bytes if d.total_bytes else 0
        text = f"{human(d.used_bytes)} of {human(d.total_bytes)} used ({ratio:.0%})"
        subject = shown(f"GPU {d.gpu} {d.name}")
        if ratio > T.GPU_MEMORY_FULL_RATIO:
            remedy = "lower --gpu-memory-utilization or stop the other GPU processes"
            report.add("warn", "gpu", subject, text + ": less than 2 % free", remedy)
        else:
            report.add("ok", "gpu", subject, text)
    for skipped in gpus.errors:
        text, remedy = (
            f"GPU skipped: {shown(skipped)}",
            "nvidia-smi; dmesg | grep -i xid",
        )
        report.add("warn", "gpu", "NVML", text, remedy)
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
    need = BACKEND_SHM.get(backend)
    for facts in report.facts.get("shm", []) if need else ():
        effective = facts["effective_size_bytes"]
        if effective < need and not (required and required >= need):
            text = f"can hold {human(effective)}, under the {human(need)} recommended for {backend}"
            report.add("warn", "shm", shown(facts["mount"]), text, shm_remedy(need))
    return report


def names_by(model: Model, paths: Paths, deadline: float) -> Links:
    """names.leaked_names by `deadline`; a mount that does not answer: files as listed."""
    try:
        return Bounded(lambda: leaked_names(model, paths, deadline)).result(deadline)
    except (TimeoutError, OSError):
        return None


def main(argv: Sequence[str], collect: Callable[[Config, float], Model]) -> int:
    """`collect(cfg, timeout)`: one run of every source, and the model made of it."""
    try:
        started = time.monotonic()
        parser = build_parser(prog="shmwatch check")
        for flag, options in FLAGS.items():
            dest = flag[2:].replace(".", "_").replace("-", "_")
            if "type" in options:
                options = dict(options, type=typed(options["type"]))
            parser.add_argument(flag, dest=dest, help=HELP.get(flag), **options)
        try:
            cfg, extra = parse_args(list(argv), parser=parser)
        except SystemExit as err:
            # argparse and a bad flag value exit 2, which here means "a requirement failed"
            raise SystemExit(EXIT_USAGE if err.code == 2 else err.code) from None
        logging.basicConfig(level=logging.CRITICAL)  # failures are in the report
        collectors = max(cfg.gpu_timeout, cfg.collector_timeout) + 1
        timeout = extra.timeout or collectors + READS_SECONDS
        deadline = started + timeout
        # A path on a hung filesystem does not answer stat() either: its scan will say so.
        checks = [(p, Bounded(lambda p=p: refusal(p))) for p in extra.log]
        for path, check in checks:
            try:
                problem = check.result(started + timeout / 4)
            except TimeoutError:
                continue
            if problem:
                sys.stderr.write(f"{USAGE}{shown(path)}: {problem}\n")
                return EXIT_USAGE
        model = collect(cfg, min(collectors, left(deadline)))
        # Logs after collecting: matching holds the GIL; collectors would time out
        until = deadline - timeout / 10  # early enough to be reported
        scans = [(p, Bounded(lambda p=p: scan_log(p, until))) for p in extra.log]
        paths = Paths(cfg.procfs, cfg.sysfs, cfg.rootfs)
        links = names_by(model, paths, until)
        report = diagnose(model, extra.require_shm, extra.backend, links)
        # before the logs: one on a hung filesystem is awaited until the deadline
        outside(report, model, paths, deadline)
        log_findings(report, scans, deadline)
        host, flag = model.host_memory, cfg.memory_limit_bytes
        if host is not None and flag is not None and flag >= host.total_bytes:
            text = f"{human(flag)} is at or above the host's memory: taken as no limit given"
            remedy = "a container without a memory limit gets the node's memory from the Downward API"
            report.add("warn", "memory", "--memory.limit-bytes", text, remedy)
        advice = R.advise(report, model, extra, deadline) if extra.recommend else ""
        json = extra.output == "json"
        if hasattr(sys.stdout, "reconfigure"):  # a character it cannot encode: \uXXXX
            sys.stdout.reconfigure(errors="backslashreplace")
        sys.stdout.write(render_json(report) if json else render_text(report) + advice)
        return report.exit_code
    except Exception as err:
        traceback.print_exc()
        name = type(err).__name__
        sys.stderr.write(f"shmwatch check: internal error ({name}), please report it\n")
        return EXIT_SOFTWARE
