"""One sample line of the text format (0.0.4), as prometheus_client's generate_latest
writes it: the same line in OpenMetrics 1.0.0 for the gauges and counters (legacy names, no
timestamps, exemplars or units) this exporter makes. Shared by the renderer
(families.Families, which formats as it goes) and the encoders (bodies.py)."""

from __future__ import annotations

import functools
import re
from typing import List, Sequence, Tuple

from prometheus_client.utils import floatToGoString


LEGACY_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def _escape_value(value: str) -> str:
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


@functools.lru_cache(maxsize=1024)
def line_template(sample_name: str, names: Tuple[str, ...]) -> str:
    """A str.format template for one sample line with labels `names` (values given in that
    order), written as generate_latest writes them: sorted by label name. Names are legacy
    names (no braces); a line is then one format call, not a join per label."""
    if not names:
        return sample_name + " {v}\n"
    inner = ",".join(
        names[i] + '="{' + str(i) + '}"'
        for i in sorted(range(len(names)), key=names.__getitem__)
    )
    return sample_name + "{{" + inner + "}} {v}\n"


def format_line(template: str, values: Sequence[str], value: float) -> str:
    """One sample line from its template (line_template) and label values."""
    joined = "".join(values)
    if "\\" in joined or "\n" in joined or '"' in joined:  # rare: escape value by value
        values = [_escape_value(v) for v in values]
    return template.format(*values, v=floatToGoString(value))


def sample_line(sample, order: List[str]) -> str:
    """One sample as generate_latest writes it; `order` is its label names, sorted."""
    labels = sample.labels
    return format_line(
        line_template(sample.name, tuple(order)),
        [labels[k] for k in order],
        sample.value,
    )
