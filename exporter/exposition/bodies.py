"""/metrics bodies from families that carry their sample lines (families.py).

The text format 0.0.4 and OpenMetrics 1.0.0 are each family's HELP and TYPE lines and its
sample lines, joined: byte for byte what prometheus_client's encoders write, without
formatting every sample again. Whatever else `choose_encoder` picks (a later OpenMetrics,
an escaping that rewrites names), and families without lines, are left to the encoder.
"""

from __future__ import annotations

from typing import Callable, Iterable, List, Optional

from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics import exposition as openmetrics

# Escapings (prometheus-client >= 0.22) that leave legacy names as they are.
LEGACY_SAFE_ESCAPINGS = ("underscores", "allow-utf-8")


class Frozen:
    """Families of one render, for the encoders (they take anything with collect())."""

    def __init__(self, metrics: Iterable[Metric]):
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return iter(self.metrics)


def joined_format(encoder: Callable) -> Optional[str]:
    """ "text" or "openmetrics" when joining lines makes what `encoder` (from choose_encoder)
    writes: a function in old prometheus-client, a partial with keywords in newer ones."""
    func = getattr(encoder, "func", encoder)
    keywords = getattr(encoder, "keywords", None) or {}
    if keywords.get("escaping", "underscores") not in LEGACY_SAFE_ESCAPINGS:
        return None
    if func is generate_latest:
        return "text"
    if (
        func is openmetrics.generate_latest
        and keywords.get("version", "1.0.0") == "1.0.0"
    ):
        return "openmetrics"
    return None


def encode(metrics: List[Metric], encoder: Callable) -> bytes:
    """The body `encoder` writes for `metrics`."""
    kind = joined_format(encoder)
    if kind is None or not all(hasattr(m, "lines") for m in metrics):
        return encoder(Frozen(metrics))
    out: List[str] = []
    for metric in metrics:
        name = metric.name
        doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
        if kind == "openmetrics":
            doc = doc.replace('"', r"\"")
        elif metric.type == "counter":
            name += "_total"  # the text format names a counter's family by its sample
        out.append(f"# HELP {name} {doc}\n# TYPE {name} {metric.type}\n")
        out.extend(metric.lines)
    if kind == "openmetrics":
        out.append("# EOF\n")
    return "".join(out).encode("utf-8")
