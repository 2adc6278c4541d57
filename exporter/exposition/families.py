"""Metric families as a render builds them: samples and their text lines by family name,
replayed per mount from the last render while what they were made from is unchanged.

A DaemonSet's model changes every poll, but few of its 5,000 samples do: lines are kept
by their inputs (LineCache) and a mount's samples by what they were made from
(FragmentCache), and prometheus_client's Metric objects are made once per render.
"""

from __future__ import annotations

import operator
from typing import (
    Callable,
    Dict,
    Iterable,
    Iterator,
    List,
    NamedTuple,
    Optional,
    Sequence,
    Tuple,
)

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.samples import Sample

from exporter.model.catalogue import lookup, node_labels
from exporter.exposition.sample_lines import format_line, line_template


class LineCache:
    """Samples and their text lines from the last render, by (name, label values, value).

    A DaemonSet's model changes every poll, but few of its 5,000 samples do: a render reuses
    the rest as they were, formatted, instead of building and formatting each again. Only
    what the current render used is kept for the next.
    """

    def __init__(self) -> None:
        self.previous: Dict[tuple, Tuple[object, str]] = {}
        self.current: Dict[tuple, Tuple[object, str]] = {}
        self.tails: Dict[
            tuple, tuple
        ] = {}  # (mount, node labels) -> their values, per render

    def next_render(self) -> None:
        self.previous, self.current, self.tails = self.current, {}, {}


class FragmentCache:
    """Per mount and renderer, the samples it rendered last and what they were made from.
    Objects in `same` are compared by identity (the cache holds them, so an id is never
    reused while it is compared); `equal` by value. Only what the current render used is
    kept for the next. Runs of RUN consecutive fragments are also kept merged (`runs`),
    by their first fragment's place, while each of theirs is the same record."""

    def __init__(self) -> None:
        self.previous: Dict[tuple, tuple] = {}
        self.current: Dict[tuple, tuple] = {}
        self.runs_previous: Dict[tuple, tuple] = {}
        self.runs_current: Dict[tuple, tuple] = {}

    def next_render(self) -> None:
        self.previous, self.current = self.current, {}
        self.runs_previous, self.runs_current = self.runs_current, {}


# Fragments are replayed by runs of this many: a node's render replays 1,500 fragments of
# ~7 families each, and a run of 16 unchanged ones is one merged record (Families.fragments),
# so a render that one event changed extends each family's lists ~100 times, not 10,000.
RUN = 16


def _identical(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


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
        family_name = kind(
            name, entry.help, labels=list(labelnames)
        ).name  # validated; a counter's without _total
        sample_name = family_name + "_total" if entry.type == "counter" else family_name
        shape = _SHAPES[(name, node_mode)] = _Shape(
            kind,
            entry.help,
            labelnames,
            tuple(added),
            entry.labels.index("mount") if "mount" in entry.labels else -1,
            sample_name,
            line_template(sample_name, labelnames),
        )
    return shape


class Families:
    """Samples and their text lines by family name, families made from the catalogue when
    iterated (not per fragment: a node's 600 fragments each made a dozen).

    In node mode every mount-level series also carries pod_uid/volume/container_id (from
    `mount_labels`), cgroup series their pod_uid, as catalogue.node_labels says.
    """

    def __init__(
        self,
        node_mode: bool = False,
        mount_labels: Optional[Callable[[str], Dict[str, str]]] = None,
        cache: Optional[LineCache] = None,
    ) -> None:
        self._parts: Dict[str, Tuple[list, list]] = {}  # name -> (samples, their lines)
        self.node_mode = node_mode
        self.mount_labels = mount_labels or (lambda mount: {})
        self.cache = cache or LineCache()

    def _lists(self, name: str) -> Tuple[list, list]:
        parts = self._parts.get(name)
        if parts is None:
            parts = self._parts[name] = ([], [])
        return parts

    def fragments(
        self,
        cache: "FragmentCache",
        items: Iterable[Tuple[tuple, tuple, tuple, Callable[["Families"], None]]],
    ) -> None:
        """What each item's `render` adds for one mount (items: where, same, equal, render),
        in order; replayed from the last render when its inputs are the same objects (`same`)
        and equal values (`equal`): a node's 200 mounts, of which an event changed one, cost
        one mount's samples, not 6,000. Replayed by runs of RUN, merged once the run's
        records are the last render's again."""
        run: List[tuple] = []
        first: Optional[tuple] = None
        for where, same, equal, render in items:
            if not run:
                first = where
            run.append(self._record(cache, where, same, equal, render))
            if len(run) == RUN:
                self._replay_run(cache, first, run)
                run = []
        if run:
            self._replay_run(cache, first, run)

    def _record(
        self,
        cache: "FragmentCache",
        where: tuple,
        same: tuple,
        equal: tuple,
        render: Callable[["Families"], None],
    ) -> tuple:
        known = cache.previous.get(where)
        if (
            known is None
            or known[1] != equal
            or (same and not _identical(known[0], same))
        ):
            staged = self.child()
            render(staged)
            known = (
                same,
                equal,
                [
                    (name, samples, lines)
                    for name, (samples, lines) in staged._parts.items()
                ],
            )
        cache.current[where] = known
        return known

    def _replay_run(
        self, cache: "FragmentCache", first: tuple, run: List[tuple]
    ) -> None:
        """Replays the run merged when it is the last render's run again (merged then, once),
        else fragment by fragment: a render after a full scan, where every run is new, does
        not pay for merging on top of replaying."""
        known = cache.runs_previous.get(first)
        if known is None or not _identical(known[0], run):
            cache.runs_current[first] = (tuple(run), None)
            for record in run:
                self._replay(record[2])
            return
        if known[1] is None:
            known = (known[0], self._merged(run))
        cache.runs_current[first] = known
        self._replay(known[1])

    @staticmethod
    def _merged(run: List[tuple]) -> list:
        """The run's records as one: each family's samples and lines in the run's order."""
        merged: Dict[str, Tuple[list, list]] = {}
        for record in run:
            for name, samples, lines in record[2]:
                mine = merged.get(name)
                if mine is None:
                    merged[name] = (samples[:], lines[:])
                else:
                    mine[0].extend(samples)
                    mine[1].extend(lines)
        return [(name, samples, lines) for name, (samples, lines) in merged.items()]

    def _replay(self, recorded: list) -> None:
        parts = self._parts
        for name, samples, lines in recorded:
            mine = parts.get(name)
            if mine is None:
                parts[name] = (
                    samples[:],
                    lines[:],
                )  # the recorded lists are replayed again
            else:
                mine[0].extend(samples)
                mine[1].extend(lines)

    def add(
        self,
        name: str,
        labels: Sequence[str],
        value: float,
        extra: Optional[Dict[str, str]] = None,
    ) -> None:
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
                tail = self.cache.tails[tail_key] = tuple(
                    from_mount.get(label) or "" for label in added
                )
            values = (*labels, *tail)
        else:
            from_mount = self.mount_labels(labels[mount_at]) if mount_at >= 0 else {}
            values = (
                *labels,
                *(
                    from_mount.get(label) or (extra or {}).get(label, "")
                    for label in added
                ),
            )
        key = (
            name,
            values,
            value or repr(value),
        )  # 0.0 and -0.0 are equal, not written alike
        known = self.cache.previous.get(key)
        if known is None:
            known = (
                Sample(shape.sample_name, dict(zip(shape.labelnames, values)), value),
                format_line(shape.template, values, value),
            )
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
            family.lines = (
                lines  # the text format's line of each sample (bodies.text_format)
            )
            yield family
