"""`shmwatch check`: runs every collector once and prints what is wrong, worst first, each
problem with its remedy (GPU, shm mounts, memory, SysV, server logs); exit codes: findings.py."""

from __future__ import annotations

import logging
import math
import os
import stat
import sys
import time
import traceback
from dataclasses import asdict
from typing import Callable, Dict, Optional, Sequence

from exporter.check import recommend as R
from exporter.check import thresholds as T
from exporter.check.findings import EXIT_SOFTWARE, EXIT_USAGE, Bounded, Report, left
from exporter.check.findings import render_json, render_text
from exporter.check.kernel import oom_kills, outside, sysv
from exporter.check.logscan import TABLE, LogHit, scan_log
from exporter.check.shm import shm, shm_remedy
from exporter.check.sizes import at_least, at_most, human, plausible
from exporter.host.paths import Paths
from exporter.config import Config, build_parser, parse_args, parse_size, typed
from exporter.model.step import Model

# Recommended shm per backend. vLLM's and SGLang's docs name no number: 16Gi holds NCCL's
# segments, the engines' shm queues and multimodal caches in tensor-parallel serving;
# TensorRT-LLM, with its own shm-based IPC, gets 80Gi (NVIDIA's large-model examples go higher).
BACKEND_SHM = {"vllm": 16 << 30, "sglang": 16 << 30, "trtllm": 80 << 30}
# Without --timeout: what the reads after the collectors (Prometheus, an exporter) may add.
READS_SECONDS = 10.0
# A source that failed is a warning in its area (shm when not named). gpu, cgroup and oom
# failures are info with their own findings (no driver, or no readable cgroup, is normal);
# "process" is shmwatch's own process metrics, nothing `check` reports on.
FAILURE_AREAS = {"sysv": "sysv", "host_memory": "memory"}
QUIET_FAILURES = ("gpu", "cgroup", "process", "oom")


def _seconds(text: str) -> float:
    seconds = float(text)
    if not 0 < seconds < math.inf:
        raise ValueError(f"not a number of seconds above 0: {text!r}")
    return seconds


# `shmwatch check`'s own flags (the exporter's are in exporter/config.py); dest: the flag's name
# with _ for . and -, as in --prometheus.url -> prometheus_url; a type's ValueError names the flag.
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


def diagnose(model: Model, required=None, backend=None) -> Report:
    """The report, from the model alone: no totals, thresholds or class rules of its own.
    `required`: --require-shm's bytes."""
    report, failed = Report(), [s for s in model.statuses if not s.success]
    errors = {s.name: s.error or "no answer within --timeout" for s in failed}
    _gpu(report, model.gpu, errors.get("gpu"))
    for view in model.mounts:
        if view.usage is not None:
            shm(report, view, model, required)
    kills = {c.cgroup: c.kills for c in model.oom_kills}
    if model.node_mode:
        _pod_memory(report, model.cgroups, kills)
    _memory(report, model, kills, errors.get("cgroup"))
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
            report.add("warn", "shm", facts["mount"], text, shm_remedy(need))
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
        subject = f"GPU {d.gpu} {d.name}"
        if ratio > T.GPU_MEMORY_FULL_RATIO:
            remedy = "lower --gpu-memory-utilization or stop the other GPU processes"
            report.add("warn", "gpu", subject, text + ": less than 2 % free", remedy)
        else:
            report.add("ok", "gpu", subject, text)
    for skipped in gpus.errors:
        text, remedy = f"GPU skipped: {skipped}", "nvidia-smi; dmesg | grep -i xid"
        report.add("warn", "gpu", "NVML", text, remedy)


def _memory(report: Report, model: Model, kills, cgroup_error: Optional[str]) -> None:
    host = model.host_memory
    if host is not None:
        ratio = host.available_bytes / host.total_bytes if host.total_bytes else 1
        report.facts["host_memory"] = asdict(host)
        low = ratio < T.HOST_MEMORY_AVAILABLE_LOW_RATIO
        text = (
            f"{human(host.available_bytes)} of {human(host.total_bytes)} available "
            f"({ratio:.0%}), shmem {human(host.shmem_bytes)}"
        )
        remedy = "free leaked shm, move workloads" if low else ""
        report.add("warn" if low else "ok", "memory", "host", text, remedy)
    if model.node_mode:
        return  # every pod's cgroup is reported by _pod_memory
    cgroup = model.cgroups[0] if model.cgroups else None
    if cgroup is None:
        if cgroup_error:
            report.add("info", "memory", "cgroup", f"not read: {cgroup_error}")
        return
    report.facts["cgroup"] = asdict(cgroup)
    name, risk, text = cgroup.cgroup, cgroup.oom_risk_ratio, _working_set(cgroup)
    if risk is None:
        text += ", no memory limit: OOM ratios not computed (pass --memory.limit-bytes)"
        report.add("info", "memory", name, text)
        return
    if cgroup.estimated:
        text += " (estimated: the workload's resident memory and shm; its cgroup is not readable here)"
    if cgroup.shmem_bytes is not None:
        text += f", shmem {human(cgroup.shmem_bytes)}"
    high = risk > T.OOM_RISK_RATIO
    remedy = "raise the memory limit or free shm" if high else ""
    report.add("warn" if high else "ok", "memory", name, text, remedy)
    _kills(report, name, kills.get(name, cgroup.oom_kills))
    for view in (v for v in model.mounts if v.cgroup is cgroup and v.budget):
        budget = view.budget
        if (budget.projection or 0) > T.SHM_OOM_PROJECTION_RATIO:
            text = (
                f"filling it ({human(budget.fillable_bytes)}) would need {budget.projection:.0%} "
                "of the memory limit: the pod is OOM-killed before tmpfs says ENOSPC"
            )
            remedy = f"lower sizeLimit to at most {at_most(budget.room_bytes)} or raise the memory limit"
            report.add("warn", "memory", view.mount, text, remedy)


def _working_set(c) -> str:
    text = f"working set {human(c.working_set_bytes)}"
    if c.oom_risk_ratio is not None:
        text += f" of {human(c.limit_bytes)} limit ({c.oom_risk_ratio:.0%})"
    return text


def _kills(report: Report, subject: str, kills: Optional[int]) -> None:
    if kills:
        remedy = "count /dev/shm in the memory budget"
        report.add("warn", "memory", subject, f"{kills} OOM kill(s) so far", remedy)


def _pod_memory(report: Report, pods, kills: Dict[str, int]) -> None:
    report.facts["pod_cgroups"] = [asdict(c) for c in pods]
    risky = 0
    for c in pods:
        subject = f"pod {c.pod_uid}"
        if (c.oom_risk_ratio or 0) > T.OOM_RISK_RATIO:
            risky += 1
            remedy = "raise the pod's memory limit or free its shm"
            report.add("warn", "memory", subject, _working_set(c), remedy)
        _kills(report, subject, kills.get(c.cgroup))
    if not risky:
        none_above = f"none above {T.OOM_RISK_RATIO:.0%} of its limit"
        report.add("ok", "memory", "pods", f"{len(pods)} pod cgroup(s), {none_above}")


def main(argv: Sequence[str], collect: Callable[[Config, float], Model]) -> int:
    """`collect(cfg, timeout)`: one run of every source, and the model made of it. A failure
    of check itself (a bug) exits EXIT_SOFTWARE, apart from 1 (warnings) and 2 (failed)."""
    try:
        return _check(argv, collect)
    except Exception as err:
        traceback.print_exc()
        name = type(err).__name__
        sys.stderr.write(f"shmwatch check: internal error ({name}), please report it\n")
        return EXIT_SOFTWARE


def _check(argv: Sequence[str], collect: Callable[[Config, float], Model]) -> int:
    started = time.monotonic()
    parser = build_parser(prog="shmwatch check")
    for flag, options in FLAGS.items():
        dest = flag[2:].replace(".", "_").replace("-", "_")
        if "type" in options:
            options = dict(options, type=typed(options["type"], flag))
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
    checks = [(p, Bounded(lambda p=p: _unreadable_log(p))) for p in extra.log]
    for path, check in checks:
        try:
            problem = check.result(started + timeout / 4)
        except TimeoutError:
            continue
        if problem:
            error = f"shmwatch check: error: argument --log: {path}: {problem}\n"
            sys.stderr.write(error)
            return EXIT_USAGE
    model = collect(cfg, min(collectors, left(deadline)))
    # Logs are read after the collectors (their matching holds the GIL, which would slow the
    # collectors past their timeouts), until early enough to be reported.
    until = deadline - timeout / 10
    scans = [(p, Bounded(lambda p=p: scan_log(p, until))) for p in extra.log]
    report = diagnose(model, extra.require_shm, extra.backend)
    # before the logs: one on a hung filesystem is awaited until the deadline
    outside(report, model, Paths(cfg.procfs, cfg.sysfs, cfg.rootfs), deadline)
    _logs(report, scans, deadline)
    host, flag = model.host_memory, cfg.memory_limit_bytes
    if host is not None and flag is not None and flag >= host.total_bytes:
        above = "is at or above the host's memory: taken as no limit given"
        text = f"{human(flag)} {above}"
        remedy = "a container without a memory limit gets the node's memory from the Downward API"
        report.add("warn", "memory", "--memory.limit-bytes", text, remedy)
    advice = ""
    if extra.recommend:
        recs, notes = R.recommendations(model, extra, deadline)
        for r in [r for r in recs if r.memory_limit_fits is False]:
            size = human(r.recommended_size_bytes)
            limit = human(r.memory_limit_bytes)
            text = f"the recommended {size} of shm does not fit in what the {limit} memory limit leaves"
            remedy = f"raise the memory limit to {at_least(r.memory_limit_bytes_needed)}, then the shm size"
            report.add("warn", "memory", r.mount, text, remedy)
        report.facts["recommendations"] = [asdict(r) for r in recs]
        report.facts["recommendation_notes"] = notes
        advice = R.render_text(recs, notes, extra.recommend_headroom)
    if extra.output == "json":
        sys.stdout.write(render_json(report))
    else:
        sys.stdout.write(render_text(report) + advice)
    return report.exit_code


def _unreadable_log(path: str) -> str:
    """Why --log's `path` is not read: only a readable regular file is (a FIFO with no writer
    blocks, a device such as /dev/zero never ends)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "not a regular file"
    except OSError as err:
        return f"cannot read it: {err.strerror}"
    return "" if os.access(path, os.R_OK) else "cannot read it"


def _logs(report: Report, scans, deadline: float) -> None:
    """The signatures the logs' scans found by `deadline` (each once, at its first hit), and
    what was not read."""
    hits: Dict[str, LogHit] = {}
    for path, task in scans:
        name = os.path.basename(path)
        try:
            scan = task.result(deadline)
        except TimeoutError:
            report.add("warn", "log", name, "not read within --timeout")
            continue
        except (OSError, ValueError) as err:
            report.add("warn", "log", name, f"not read: {err}")
            continue
        for signature, found in scan.hits.items():
            hits.setdefault(signature, found[0])
        tail, size = scan.size - scan.start, scan.size
        if scan.start:
            text = f"only its last {human(tail)} of {human(size)} read"
            report.add("info", "log", name, text)
        if scan.end < size:
            read = f"{human(scan.end - scan.start)} of {human(tail)} read"
            text = f"not read to its end within --timeout: {read}"
            report.add("warn", "log", name, text)
    for signature, hit in hits.items():
        where = os.path.basename(hit.file)
        where += f":{hit.line}" if hit.line else f" at byte {hit.offset}"
        said, fields = TABLE[signature], hit.fields
        text = said["explanation"].format_map(fields) + f" Seen: {hit.text}"
        report.add("warn", "log", where, text, said["remedy"].format_map(fields))
