"""Metric families as a render builds them: samples and their text lines by family name,
replayed per mount from the last render while what they were made from is unchanged.

A DaemonSet's model changes every poll, but few of its 5,000 samples do: lines are kept
by their inputs (LineCache) and a mount's samples by what they were made from
(FragmentCache), and prometheus_client's Metric objects are made once per render.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterator, NamedTuple, Optional, Sequence, Tuple

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from .catalogue import lookup, node_labels
from .sample_lines import format_line, line_template


class LineCache:
    """Samples and their text lines from the last render, by (name, label values, value).

    A DaemonSet's model changes every poll, but few of its 5,000 samples do: a render reuses
    the rest as they were, formatted, instead of building and formatting each again. Only
    what the current render used is kept for the next.
    """

    def __init__(self) -> None:
        self.previous: Dict[tuple, Tuple[object, str]] = {}
        self.current: Dict[tuple, Tuple[object, str]] = {}
        self.tails: Dict[tuple, tuple] = {}  # (mount, node labels) -> their values, per render

    def next_render(self) -> None:
        self.previous, self.current, self.tails = self.current, {}, {}


class FragmentCache:
    """Per mount and renderer, the samples it rendered last and what they were made from.
    Objects in `same` are compared by identity (the cache holds them, so an id is never
    reused while it is compared); `equal` by value. Only what the current render used is
    kept for the next."""

    def __init__(self) -> None:
        self.previous: Dict[tuple, tuple] = {}
        self.current: Dict[tuple, tuple] = {}

    def next_render(self) -> None:
        self.previous, self.current = self.current, {}

    def get(self, where: tuple, same: tuple, equal: tuple):
        known = self.previous.get(where)
        if known is None or len(known[0]) != len(same) or known[1] != equal \
                or any(a is not b for a, b in zip(known[0], same)):
            return None
        self.current[where] = known
        return known[2]

    def put(self, where: tuple, same: tuple, equal: tuple, recorded: list) -> None:
        self.current[where] = (same, equal, recorded)


class _Shape(NamedTuple):
    """What every sample of one family needs, looked up once per family name and mode."""
    kind: type
    help: str
    labelnames: Tuple[str, ...]
    added: Tuple[str, ...]  # node labels
    mount_at: int  # index of the mount label, or -1
    sample_name: str  # a counter's with _total
    template: str  # sample_lines.line_template


_SHAPES: Dict[Tuple[str, bool], _Shape] = {}


def _shape(name: str, node_mode: bool) -> _Shape:
    shape = _SHAPES.get((name, node_mode))
    if shape is None:
        entry = lookup(name)
        added = node_labels(entry) if node_mode else ()
        kind = CounterMetricFamily if entry.type == "counter" else GaugeMetricFamily
        labelnames = tuple(entry.labels) + tuple(added)
        family_name = kind(name, entry.help, labels=list(labelnames)).name  # validated; a counter's without _total
        sample_name = family_name + "_total" if entry.type == "counter" else family_name
        shape = _SHAPES[(name, node_mode)] = _Shape(
            kind, entry.help, labelnames, tuple(added), entry.labels.index("mount") if "mount" in entry.labels else -1,
            sample_name, line_template(sample_name, labelnames))
    return shape


class Families:
    """Samples and their text lines by family name, families made from the catalogue when
    iterated (not per fragment: a node's 600 fragments each made a dozen).

    In node mode every mount-level series also carries pod_uid/volume/container_id (from
    `mount_labels`), cgroup series their pod_uid, as catalogue.node_labels says.
    """

    def __init__(self, node_mode: bool = False,
                 mount_labels: Optional[Callable[[str], Dict[str, str]]] = None,
                 cache: Optional[LineCache] = None) -> None:
        self._parts: Dict[str, Tuple[list, list]] = {}  # name -> (samples, their lines)
        self.node_mode = node_mode
        self.mount_labels = mount_labels or (lambda mount: {})
        self.cache = cache or LineCache()

    def _lists(self, name: str) -> Tuple[list, list]:
        parts = self._parts.get(name)
        if parts is None:
            parts = self._parts[name] = ([], [])
        return parts

    def fragment(self, cache: "FragmentCache", where: tuple, same: tuple, equal: tuple,
                 render: Callable[["Families"], None]) -> None:
        """What `render` adds for one mount, replayed from the last render when its inputs
        are the same objects (`same`) and equal values (`equal`): a node's 200 mounts, of
        which an event changed one, cost one mount's samples, not 6,000."""
        recorded = cache.get(where, same, equal)
        if recorded is None:
            staged = self.child()
            render(staged)
            recorded = [(name, samples, lines) for name, (samples, lines) in staged._parts.items()]
            cache.put(where, same, equal, recorded)
        parts = self._parts
        for name, samples, lines in recorded:
            mine = parts.get(name)
            if mine is None:
                parts[name] = (samples[:], lines[:])  # the recorded lists are replayed again
            else:
                mine[0].extend(samples)
                mine[1].extend(lines)

    def add(self, name: str, labels: Sequence[str], value: float, extra: Optional[Dict[str, str]] = None) -> None:
        shape = _SHAPES.get((name, self.node_mode)) or _shape(name, self.node_mode)
        added, mount_at = shape.added, shape.mount_at
        if not added:
            values = tuple(labels)
        elif extra is None and mount_at >= 0:
            # A mount's node labels, looked up once per render and mount, not once per sample.
            tail_key = (labels[mount_at], added)
            tail = self.cache.tails.get(tail_key)
            if tail is None:
                from_mount = self.mount_labels(labels[mount_at])
                tail = self.cache.tails[tail_key] = tuple(from_mount.get(label) or "" for label in added)
            values = (*labels, *tail)
        else:
            from_mount = self.mount_labels(labels[mount_at]) if mount_at >= 0 else {}
            values = (*labels, *(from_mount.get(label) or (extra or {}).get(label, "") for label in added))
        key = (name, values, value or repr(value))  # 0.0 and -0.0 are equal, not written alike
        known = self.cache.previous.get(key)
        if known is None:
            known = (Sample(shape.sample_name, dict(zip(shape.labelnames, values)), value),
                     format_line(shape.template, values, value))
        self.cache.current[key] = known
        samples, lines = self._parts.get(name) or self._lists(name)
        samples.append(known[0])
        lines.append(known[1])

    def child(self) -> "Families":
        return Families(self.node_mode, self.mount_labels, self.cache)

    def merge(self, other: "Families") -> None:
        parts = self._parts
        for name, (samples, lines) in other._parts.items():
            mine = parts.get(name)
            if mine is None:
                parts[name] = (samples, lines)  # the other is discarded
            else:
                mine[0].extend(samples)
                mine[1].extend(lines)

    def __iter__(self) -> Iterator[Metric]:
        for name, (samples, lines) in self._parts.items():
            shape = _shape(name, self.node_mode)
            family = shape.kind(name, shape.help, labels=list(shape.labelnames))
            family.samples = samples
            family.lines = lines  # the text format's line of each sample (exposition.text_format)
            yield family
