"""The README's flags, metrics and segment class tables, generated from the flags' declarations
(exporter/config.py's Config), the catalogue and exporter/model/classes.py.

    python3 docs/generate.py README.md     # rewrite the tables in place

tests/project/test_docs.py fails when the README's tables differ from what this prints. It lives
outside the package: the exporter never needs it.
"""

from __future__ import annotations

import os
import re
import sys

# Run as a script from anywhere: the checkout's package, not an installed one.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exporter.config import table_rows  # noqa: E402
from exporter.model.catalogue import CATALOGUE  # noqa: E402
from exporter.model.classes import CLASSES, NOT_LEAKS, REMOVABLE  # noqa: E402


def flags_table() -> str:
    rows = ["| flag | env | default | what |", "|---|---|---|---|"]
    for row in table_rows():
        rows.append(f"| {row.flag} | {row.env} | {row.default} | {row.what} |")
    return "\n".join(rows)


def metrics_table() -> str:
    """A row per family; default: in the default set ("on"), or opt-in."""
    rows = ["| metric | type | labels | default | what |", "|---|---|---|---|---|"]
    for m in CATALOGUE:
        labels = ", ".join(m.labels) if m.labels else "—"
        default = "on" if m.default else "opt-in"
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {default} | {m.help} |")
    return "\n".join(rows)


def classes_table() -> str:
    """exporter/model/classes.py's rows, first match wins; what `check` advises for an orphan."""
    rows = [
        "| class | basename | where the name comes from | orphan |",
        "|---|---|---|---|",
    ]
    for rule in CLASSES:
        orphan = (
            "`rm` advised"
            if rule.cls in REMOVABLE
            else "not a leak"
            if rule.cls in NOT_LEAKS
            else "reported, no advice"
        )
        shown = rule.pattern.replace("\\.", ".").replace(".*", "*").replace("|", "\\|")
        rows.append(f"| {rule.cls} | `{shown}` | {rule.source.replace('<', '&lt;')} | {orphan} |")
    rows.append("| other | anything else | | reported, no advice |")
    return "\n".join(rows)


def replace_block(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name}:begin -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {name}:begin/end --> markers")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv) -> int:
    readme = argv[0] if argv else "README.md"
    # The class table lives in docs/check.md beside the README (which stays short).
    check_md = os.path.join(os.path.dirname(readme), "docs", "check.md")
    for path, blocks in (
        (readme, (("flags", flags_table()), ("metrics", metrics_table()))),
        (check_md, (("classes", classes_table()),)),
    ):
        with open(path) as f:
            text = f.read()
        for name, table in blocks:
            text = replace_block(text, name, table)
        with open(path, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
