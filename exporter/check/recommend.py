"""Right-sizing the shm volume from what the workload really used (`shmwatch check --recommend`).

One place for the formula: recommended = observed peak x headroom, rounded up to a whole GiB
(a whole MiB below 1 GiB), at least 1 MiB; the memory limit that holds it = the cgroup's use
besides this mount's shm + the recommendation, rounded up to a MiB. The recording rules
(deploy/prometheus/shmwatch-recommend-rules.yml) come from the same template, `rule_exprs`.

The observed peak, best first: Prometheus's max_over_time(shmwatch_mount_peak_used_bytes),
a running exporter's shmwatch_mount_max_used_bytes, or this run's reading (said to be weakest).
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from prometheus_client.parser import text_string_to_metric_families

from exporter.check.sizes import GiB, MiB, at_least, docker, human, k8s, round_up

DEFAULT_WINDOW, DEFAULT_HEADROOM = "7d", 1.25
Peaks = Dict[str, Tuple[float, int]]  # mount -> (peak, how many series matched)
SERIES = "{} series matched this mount; the highest was taken (narrow them with --prometheus.selector)"
NO_PEAK = (
    "no recorded peak: this is the current use only, a spike that is over is not seen"
)
WHERE = {
    "prometheus": "Prometheus, max over {}",
    "exporter": "a running shmwatch's high-water mark",
    "current": "current use: no history",
}


def recommended_size(peak: float, headroom: float = DEFAULT_HEADROOM) -> int:
    return round_up(peak * headroom)


def memory_limit_needed(recommended: int, working_set: int, shm_used: int) -> int:
    """The memory limit that holds everything else the cgroup uses plus a full recommended mount."""
    non_shm = max(0, working_set - shm_used)
    return -(-(non_shm + recommended) // MiB) * MiB


def rule_exprs(window=DEFAULT_WINDOW, headroom=DEFAULT_HEADROOM) -> Dict[str, str]:
    """record name -> PromQL, as deploy/prometheus/shmwatch-recommend-rules.yml carries them."""
    x = f"shmwatch:mount_observed_peak_bytes * {headroom:g}"
    return {
        "shmwatch:mount_observed_peak_bytes": f"max_over_time(shmwatch_mount_peak_used_bytes[{window}])",
        "shmwatch:mount_recommended_size_bytes": (
            f"clamp_min((ceil({x} / {GiB}) * {GiB} and {x} >= {GiB}) or ceil({x} / {MiB}) * {MiB}, {MiB})"
        ),
        # The mount's pod (node mode) or the one workload (sidecar: no pod_uid on either side).
        "shmwatch:mount_recommended_memory_limit_bytes": (
            "ceil((shmwatch:mount_recommended_size_bytes + clamp_min(max by (instance, job, pod_uid) "
            "(shmwatch_cgroup_memory_working_set_bytes) - on (instance, job, pod_uid) group_right () "
            f"shmwatch_mount_used_bytes, 0)) / {MiB}) * {MiB}"
        ),
    }


# --- where the observed peak comes from --------------------------------------------------------
class SourceError(Exception):
    pass


def _get(url: str, parse):
    """parse(the body at url); any failure to fetch or parse it is a SourceError."""
    try:
        with urllib.request.urlopen(url, timeout=10.0) as response:
            return parse(response.read().decode())
    except (OSError, ValueError) as err:
        raise SourceError(f"{url}: {err}") from None


def peaks_from_prometheus(url: str, mounts, window: str, selector: str) -> Peaks:
    """mount -> (highest peak over the window, how many series matched), via /api/v1/query."""
    out: Peaks = {}
    for mount in mounts:
        escaped = mount.replace("\\", "\\\\").replace('"', '\\"')
        labels = ", ".join(filter(None, [f'mount="{escaped}"', selector.strip("{} ")]))
        expr = f"max_over_time(shmwatch_mount_peak_used_bytes{{{labels}}}[{window}])"
        query = urllib.parse.urlencode({"query": expr})
        body = _get(f"{url.rstrip('/')}/api/v1/query?{query}", json.loads)
        if body.get("status") != "success":
            raise SourceError(f"{url}: {body.get('error', body)}")
        values = [float(r["value"][1]) for r in body["data"]["result"]]
        if values:
            out[mount] = (max(values), len(values))
    return out


def peaks_from_exporter(url: str) -> Peaks:
    """mount -> (a running exporter's high-water mark, 1), from its /metrics."""
    out: Peaks = {
        s.labels["mount"]: (s.value, 1)
        for family in _get(url, lambda text: list(text_string_to_metric_families(text)))
        for s in family.samples
        if s.name == "shmwatch_mount_max_used_bytes" and "mount" in s.labels
    }
    if not out:
        raise SourceError(
            f"{url}: no shmwatch_mount_max_used_bytes (an older shmwatch?)"
        )
    return out


# --- the recommendation ------------------------------------------------------------------------
@dataclass
class Recommendation:
    """`window`: Prometheus' window, None for an exporter's or this run's reading. The memory
    limit: the cgroup's now (None: unknown or unlimited), the one needed (None: the cgroup's
    use is unknown), and whether the first holds the second (None: no limit to compare)."""

    mount: str
    observed_peak_bytes: int
    recommended_size_bytes: int
    window: Optional[str]
    source: str  # prometheus | exporter | current
    current_size_bytes: int
    memory_limit_bytes: Optional[int] = None
    memory_limit_bytes_needed: Optional[int] = None
    memory_limit_fits: Optional[bool] = None
    settings: Dict[str, str] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)


def settings_for(size: int, volume: str, memory_limit: Optional[int]) -> Dict[str, str]:
    empty_dir = {"medium": "Memory", "sizeLimit": k8s(size)}
    volumes = [{"name": volume, "emptyDir": empty_dir}]
    patch = json.dumps(
        {"spec": {"template": {"spec": {"volumes": volumes}}}}, separators=(",", ":")
    )
    out = {
        "docker_run": f"docker run --shm-size={docker(size)}",
        "compose": f"shm_size: {docker(size)}",
        "kubernetes_volume": f"volumes: [{{name: {volume}, emptyDir: {{medium: Memory, sizeLimit: {k8s(size)}}}}}]",
        "kubectl_patch": f"kubectl patch deployment <name> --type=strategic -p '{patch}'",
    }
    if memory_limit is not None:
        out["docker_run_memory"] = f"docker run --memory={docker(memory_limit)}"
        out["compose_memory"] = f"mem_limit: {docker(memory_limit)}"
        out["kubernetes_memory_limit"] = (
            "kubectl set resources deployment <name> -c <container> "
            f"--limits=memory={k8s(memory_limit)}"
        )
    return out


def recommend(view, observed: float, source: str, window, headroom: float, note=""):
    """One mount's recommendation (`view`: a model MountView with usage)."""
    usage, cgroup, observed = view.usage, view.cgroup, max(int(observed), 0)
    size = recommended_size(observed, headroom)
    r = Recommendation(usage.mount, observed, size, window, source, usage.size_bytes)
    r.notes = [note] if note else []
    if cgroup is not None:
        needed = memory_limit_needed(size, cgroup.working_set_bytes, usage.used_bytes)
        r.memory_limit_bytes, r.memory_limit_bytes_needed = cgroup.limit_bytes, needed
        r.memory_limit_fits = (
            needed <= cgroup.limit_bytes if cgroup.limit_bytes else None
        )
    memory = r.memory_limit_bytes_needed if r.memory_limit_fits is False else None
    r.settings = settings_for(size, view.labels.get("volume") or "dshm", memory)
    return r


# --- `shmwatch check --recommend` --------------------------------------------------------------
def parse_window(text: str) -> str:
    """--recommend.window: a Prometheus duration."""
    if not re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", text):
        raise ValueError(f"not a Prometheus duration: {text!r} (e.g. 7d, 36h)")
    return text


def parse_headroom(text: str) -> float:
    """--recommend.headroom: a factor from 1 to 10."""
    if not 1.0 <= float(text) <= 10.0:
        raise ValueError("must be between 1 and 10")
    return float(text)


def recommendations(model, extra) -> Tuple[List[Recommendation], List[str]]:
    """Per measured mount, from the best source that answered; notes say what fell through."""
    views = [v for v in model.mounts if v.usage is not None and not v.usage.error]
    notes: List[str] = []
    answers: List[Tuple[str, Optional[str], Peaks]] = []
    selector, span = extra.prometheus_selector, extra.recommend_window
    try:
        if extra.prometheus_url:
            mounts = [v.mount for v in views]
            peaks = peaks_from_prometheus(extra.prometheus_url, mounts, span, selector)
            answers.append(("prometheus", span, peaks))
    except SourceError as err:
        notes.append(f"Prometheus not used: {err}")
    try:
        if extra.exporter_url:
            answers.append(("exporter", None, peaks_from_exporter(extra.exporter_url)))
    except SourceError as err:
        notes.append(f"exporter not used: {err}")
    out, headroom = [], extra.recommend_headroom
    for view in views:
        rec = None
        # Preferred order; a mount a source has no series for falls through to the next, and so
        # does Prometheus when several series match without --prometheus.selector: /dev/shm
        # exists in every pod, and another workload's peak is not this one's.
        for name, window, peaks in answers:
            peak, series = peaks.get(view.mount, (None, 0))
            if peak is None:
                continue
            if name == "prometheus" and series > 1 and not selector:
                notes.append(
                    f"Prometheus not used for {view.mount}: {series} series match; "
                    "name this workload's with --prometheus.selector"
                )
                continue
            note = SERIES.format(series) if series > 1 else ""
            rec = recommend(view, peak, name, window, headroom, note)
            break
        used = view.usage.used_bytes
        current = used if view.max_used_bytes is None else view.max_used_bytes
        if rec is None:
            rec = recommend(view, used, "current", None, headroom, NO_PEAK)
        elif current > rec.observed_peak_bytes:
            note = (
                f"the current use is above what {rec.source} recorded: it is the peak"
            )
            rec = recommend(view, current, "current", None, headroom, note)
        out.append(rec)
    return out, notes


def render_text(recs: List[Recommendation], notes: List[str], headroom: float) -> str:
    lines = [
        "",
        f"RECOMMENDATIONS (highest observed peak x {headroom:g}, rounded up to a whole GiB, MiB below 1 GiB)",
    ]
    for r in recs:
        where = WHERE[r.source].format(r.window)
        lines.append(
            f"{r.mount}: observed peak {human(r.observed_peak_bytes)} ({where}) -> recommended "
            f"{at_least(r.recommended_size_bytes)} (now {human(r.current_size_bytes)})"
        )
        limit = human(r.memory_limit_bytes or 0)
        needed = at_least(r.memory_limit_bytes_needed or 0)
        memory = {
            False: f"the limit of {limit} cannot hold it: raise the limit to {needed}, not only the shm size",
            True: f"the limit of {limit} holds it (needs {needed})",
            None: "no memory limit known (pass --memory.limit-bytes or read the cgroup)",
        }
        lines.append(f"  memory: {memory[r.memory_limit_fits]}")
        lines.extend(f"  {key + ':':<25}{value}" for key, value in r.settings.items())
        lines.extend(f"  note: {n}" for n in r.notes)
    lines.extend(f"note: {n}" for n in notes)
    return "\n".join(lines) + "\n"
