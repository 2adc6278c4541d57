"""`shmwatch check --recommend`: the shm volume's size from what the workload really
used, observed peak x headroom (findings.round_up), and the memory limit that holds it:
the cgroup's use besides this mount's shm + that size, rounded up to a MiB (as
deploy/prometheus/shmwatch-recommend-rules.yml records them). The observed peak, best
first: Prometheus's max_over_time(shmwatch_mount_peak_used_bytes), a running exporter's
shmwatch_mount_max_used_bytes, or this run's reading (said to be weakest)."""

import json
import math
import re
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Tuple, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from exporter.check.findings import MiB, Bounded, Report, at_least, human, left
from exporter.check.findings import plausible, quantities, round_up
from exporter.check.names import printable, shell, shown
from exporter.model.step import Model, MountView

DEFAULT_WINDOW, DEFAULT_HEADROOM = "7d", 1.25


@dataclass(frozen=True)
class SourcePeak:
    """A mount's peak as a source recorded it."""

    peak_bytes: float
    series: int  # how many series matched: the highest was taken


Peaks = Dict[str, SourcePeak]  # mount -> its recorded peak
SERIES = "{} series matched this mount; the highest was taken (narrow them with --prometheus.selector)"
NO_PEAK = (
    "no recorded peak: this is the current use only, a spike that is over is not seen"
)
WHERE = {
    "prometheus": "Prometheus, max over {}",
    "exporter": "a running shmwatch's high-water mark",
    "current": "current use: no history",
}
# The most of an answer read: a query's vector for a few mounts is a few KiB, a node's /metrics
# a few MiB. Parsing more (a JSON array of 16M numbers) would cost hundreds of MiB.
MAX_ANSWER = {"prometheus": 1 << 20, "exporter": 16 << 20}
# A running shmwatch's high-water mark, and the lines of its /metrics that carry it.
MAX_USED = "shmwatch_mount_max_used_bytes"
MAX_USED_LINE = re.compile(rb"^" + MAX_USED.encode() + rb"[{ ].*$", re.M)
T = TypeVar("T")


class RecommendFlags(Protocol):
    """check's flags a recommendation reads (report.CheckFlags)."""

    @property
    def prometheus_url(self) -> Optional[str]: ...

    @property
    def prometheus_selector(self) -> str: ...

    @property
    def exporter_url(self) -> Optional[str]: ...

    @property
    def recommend_window(self) -> str: ...

    @property
    def recommend_headroom(self) -> float: ...

    @property
    def require_shm(self) -> Optional[int]: ...


def memory_limit_needed(recommended: int, working_set: int, shm_used: int) -> int:
    non_shm = max(0, working_set - shm_used)
    return -(-(non_shm + recommended) // MiB) * MiB


class SourceError(Exception):
    pass


def _get(url: str, parse: Callable[[bytes], T], deadline: float, limit: int) -> T:
    """parse(the body at url, at most `limit` bytes); any other answer (an error, none by
    `deadline`, too much, not what parse expects, JSON nested a million deep) is a SourceError."""
    try:
        with urllib.request.urlopen(url, timeout=max(0.1, left(deadline))) as response:
            body = response.read(limit + 1)
        if len(body) > limit:
            raise ValueError(f"an answer longer than {human(limit)}")
        return parse(body)
    except Exception as err:  # the answer is another program's: any failure is a note
        said = shown(str(err) or type(err).__name__, 200)
        raise SourceError(f"{shown(url)}: {said}") from None


def _vector(body: bytes) -> List[int]:
    """The values of an instant-vector answer of /api/v1/query, each a plausible size."""
    answer = json.loads(body)
    try:
        if answer["status"] != "success":
            raise ValueError(f"the query failed: {shown(answer.get('error'), 200)}")
        if answer["data"]["resultType"] != "vector":
            raise LookupError("resultType")
        return [plausible(r["value"][1]) for r in answer["data"]["result"]]
    except (LookupError, TypeError, AttributeError) as err:
        what = f"not an instant vector ({type(err).__name__}: {err})"
        raise ValueError(what) from None


def peaks_from_prometheus(
    extra: RecommendFlags, mounts: Sequence[str], deadline: float = math.inf
) -> Peaks:
    out: Peaks = {}
    url, window = (extra.prometheus_url or "").rstrip("/"), extra.recommend_window
    for mount in mounts:
        escaped = mount.replace("\\", "\\\\").replace('"', '\\"')
        selector = [f'mount="{escaped}"', extra.prometheus_selector.strip("{} ")]
        labels = ", ".join(filter(None, selector))
        expr = f"max_over_time(shmwatch_mount_peak_used_bytes{{{labels}}}[{window}])"
        where = f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        values = _get(where, _vector, deadline, MAX_ANSWER["prometheus"])
        if values:
            out[mount] = SourcePeak(peak_bytes=max(values), series=len(values))
    return out


def _high_water_marks(body: bytes) -> Dict[str, int]:
    """mount -> its plausible MAX_USED, parsing only those lines of /metrics."""
    lines = b"\n".join(MAX_USED_LINE.findall(body)).decode() + "\n"
    found = [s for f in text_string_to_metric_families(lines) for s in f.samples]
    return {s.labels["mount"]: plausible(s.value) for s in found if "mount" in s.labels}


def peaks_from_exporter(url: str, deadline: float = math.inf) -> Peaks:
    marks = _get(url, _high_water_marks, deadline, MAX_ANSWER["exporter"])
    if not marks:
        raise SourceError(f"{shown(url)}: no {MAX_USED} (an older shmwatch?)")
    return {m: SourcePeak(peak_bytes=value, series=1) for m, value in marks.items()}


def parse_url(text: str) -> str:
    parts = urllib.parse.urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http:// or https:// URL: {text!r}")
    return text


def parse_window(text: str) -> str:
    if not re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", text):
        raise ValueError(f"not a Prometheus duration: {text!r} (e.g. 7d, 36h)")
    return text


def parse_headroom(text: str) -> float:
    if not 1.0 <= float(text) <= 10.0:
        raise ValueError("must be between 1 and 10")
    return float(text)


@dataclass
class Recommendation:
    """`window`: Prometheus', else None. Memory limit: the cgroup's (None: unknown or
    unlimited), needed (None: use unknown), whether it holds that (None: no limit)."""

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
    docker, k8s = quantities(size)
    empty_dir = {"medium": "Memory", "sizeLimit": k8s}
    volumes = [{"name": volume, "emptyDir": empty_dir}]
    spec = {"spec": {"template": {"spec": {"volumes": volumes}}}}
    patch, volume = json.dumps(spec, separators=(",", ":")), shown(volume)
    out = {
        "docker_run": f"docker run --shm-size={docker}",
        "compose": f"shm_size: {docker}",
        "kubernetes_volume": f"volumes: [{{name: {volume}, emptyDir: {{medium: Memory, sizeLimit: {k8s}}}}}]",
        "kubectl_patch": f"kubectl patch deployment <name> --type=strategic -p {shell(patch)}",
    }
    if memory_limit is not None:
        docker, k8s = quantities(memory_limit)
        out["docker_run_memory"] = f"docker run --memory={docker}"
        out["compose_memory"] = f"mem_limit: {docker}"
        out["kubernetes_memory_limit"] = (
            f"kubectl set resources deployment <name> -c <container> --limits=memory={k8s}"
        )
    return out


def recommend(
    view: MountView,
    observed: float,
    source: str,
    window: Optional[str],
    headroom: float,
    note: str = "",
    required: Optional[int] = None,
) -> Recommendation:
    """Never below --require-shm's `required` bytes; `view`: a MountView with usage."""
    usage, cgroup, peak = view.usage, view.cgroup, max(int(observed), 0)
    assert usage is not None  # only mounts measured are recommended for
    size = round_up(peak * headroom)
    notes = [note] if note else []
    if required and size < required:
        size = round_up(required)
        notes.append(
            f"raised to what --require-shm asks: at least {at_least(required)}"
        )
    limit = needed = fits = None
    if cgroup is not None:
        needed = memory_limit_needed(size, cgroup.working_set_bytes, usage.used_bytes)
        limit = cgroup.limit_bytes
        fits = needed <= limit if limit else None
    memory = needed if fits is False else None
    return Recommendation(
        mount=usage.mount,
        observed_peak_bytes=peak,
        recommended_size_bytes=size,
        window=window,
        source=source,
        current_size_bytes=usage.size_bytes,
        memory_limit_bytes=limit,
        memory_limit_bytes_needed=needed,
        memory_limit_fits=fits,
        settings=settings_for(size, view.labels.get("volume") or "dshm", memory),
        notes=notes,
    )


@dataclass(frozen=True)
class _Asked:
    """A source of peaks asked for every mount at once, on a thread of its own."""

    source: str  # prometheus | exporter
    window: Optional[str]  # Prometheus' --recommend.window; None: an exporter's mark
    label: str  # as notes name it
    url: str
    answer: Bounded[Peaks]


@dataclass(frozen=True)
class _Answer:
    source: str
    window: Optional[str]
    peaks: Peaks


@dataclass(frozen=True)
class _Peak:
    """The peak a recommendation is made from, where it was read, and a note on it."""

    observed_bytes: float
    source: str  # prometheus | exporter | current
    window: Optional[str]
    note: str


def recommendations(
    model: Model, extra: RecommendFlags, deadline: float = math.inf
) -> Tuple[List[Recommendation], List[str]]:
    """Per measured mount, from the best source that answered by `deadline` (both are asked
    at once); notes say what fell through."""
    views = [v for v in model.mounts if v.usage is not None and not v.usage.error]
    notes: List[str] = []
    answers = _answers(_ask(extra, [v.mount for v in views], deadline), deadline, notes)
    out = []
    for view in views:
        peak = _highest(view, _recorded_peak(view, answers, extra, notes))
        recommendation = recommend(
            view,
            observed=peak.observed_bytes,
            source=peak.source,
            window=peak.window,
            headroom=extra.recommend_headroom,
            note=peak.note,
            required=extra.require_shm,
        )
        out.append(recommendation)
    return out, notes


def _ask(extra: RecommendFlags, mounts: List[str], deadline: float) -> List[_Asked]:
    """Prometheus and a running exporter, each asked for every mount's peak, at once."""
    asked = []
    if extra.prometheus_url:
        task = Bounded(partial(peaks_from_prometheus, extra, mounts, deadline))
        span, url = extra.recommend_window, extra.prometheus_url
        prometheus = _Asked(
            source="prometheus", window=span, label="Prometheus", url=url, answer=task
        )
        asked.append(prometheus)
    if extra.exporter_url:
        task = Bounded(partial(peaks_from_exporter, extra.exporter_url, deadline))
        exporter = _Asked(
            source="exporter",
            window=None,
            label="exporter",
            url=extra.exporter_url,
            answer=task,
        )
        asked.append(exporter)
    return asked


def _answers(asked: List[_Asked], deadline: float, notes: List[str]) -> List[_Answer]:
    """The answers that came by `deadline`; a note for each source that did not answer."""
    answers = []
    for a in asked:
        try:
            peaks = a.answer.result(deadline)
            answers.append(_Answer(source=a.source, window=a.window, peaks=peaks))
        except SourceError as err:
            notes.append(f"{a.label} not used: {err}")
        except TimeoutError as err:  # the URL's answer has not come to an end
            notes.append(f"{a.label} not used: {shown(a.url)}: {err}")
    return answers


def _recorded_peak(
    view: MountView, answers: List[_Answer], extra: RecommendFlags, notes: List[str]
) -> _Peak:
    """The first answer's peak for this mount, else its current use. Several series and no
    --prometheus.selector: another pod's shm peak is not ours."""
    assert view.usage is not None
    for answer in answers:
        recorded = answer.peaks.get(view.mount)
        if recorded is None:
            continue
        series = recorded.series
        if (
            answer.source == "prometheus"
            and series > 1
            and not extra.prometheus_selector
        ):
            text = (
                f"Prometheus not used for {shown(view.mount)}: {series} series match; "
            )
            notes.append(text + "name this workload's with --prometheus.selector")
            continue
        note = SERIES.format(series) if series > 1 else ""
        return _Peak(
            observed_bytes=recorded.peak_bytes,
            source=answer.source,
            window=answer.window,
            note=note,
        )
    current = view.usage.used_bytes
    return _Peak(observed_bytes=current, source="current", window=None, note=NO_PEAK)


def _highest(view: MountView, peak: _Peak) -> _Peak:
    """A recorded peak below the mount's high-water mark (or its current use) is not the peak."""
    assert view.usage is not None
    high = view.max_used_bytes
    current = view.usage.used_bytes if high is None else high
    if peak.source != "current" and current > peak.observed_bytes:
        note = f"the current use is above what {peak.source} recorded: it is the peak"
        return _Peak(observed_bytes=current, source="current", window=None, note=note)
    return peak


def advise(report: Report, model: Model, extra: RecommendFlags, deadline: float) -> str:
    """The recommendations into `report` (a warning where the limit cannot hold one), as text."""
    recs, notes = recommendations(model, extra, deadline)
    report.facts["recommendations"] = [asdict(r) for r in recs]
    report.facts["recommendation_notes"] = notes
    head = f"highest observed peak x {extra.recommend_headroom:g}, rounded up to a whole GiB, MiB below 1 GiB"
    lines = ["", f"RECOMMENDATIONS ({head})"]
    for r in recs:
        size, limit = human(r.recommended_size_bytes), human(r.memory_limit_bytes or 0)
        needed = at_least(r.memory_limit_bytes_needed or 0)
        where = WHERE[r.source].format(r.window)
        lines.append(
            f"{shown(r.mount)}: observed peak {human(r.observed_peak_bytes)} ({where}) -> recommended "
            f"{at_least(r.recommended_size_bytes)} (now {human(r.current_size_bytes)})"
        )
        memory = "no memory limit known (pass --memory.limit-bytes or read the cgroup)"
        if r.memory_limit_fits:
            memory = f"the limit of {limit} holds it (needs {needed})"
        elif r.memory_limit_fits is False:
            memory = f"the limit of {limit} cannot hold it: raise the limit to {needed}, not only the shm size"
            text = f"the recommended {size} of shm does not fit in what the {limit} memory limit leaves"
            remedy = f"raise the memory limit to {needed}, then the shm size"
            report.add("warn", "memory", shown(r.mount), text, remedy)
        lines.append(f"  memory: {memory}")
        lines.extend(f"  {key + ':':<25}{value}" for key, value in r.settings.items())
        lines.extend(f"  note: {n}" for n in r.notes)
    lines.extend(f"note: {n}" for n in notes)
    # names are shown already: a last guard
    return "\n".join(map(printable, lines)) + "\n"
