"""Label values from file and process names: any bytes, any length.

The exposition format escapes only backslash, double quote and newline; everything
else must be valid UTF-8. Names in /dev/shm can be anything a process passed to
shm_open(), so decode what is not UTF-8 as U+FFFD, spell control characters as \\xNN
(a raw carriage return or escape sequence in a label breaks dashboards and terminals),
and cap the length so one hostile name cannot bloat every scrape.
"""

from __future__ import annotations

import re

MAX_LABEL_CHARS = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def clean(value: "str | bytes", limit: int = MAX_LABEL_CHARS) -> str:
    if isinstance(value, str):
        # os.scandir() hands undecodable bytes back as lone surrogates.
        value = value.encode("utf-8", "surrogateescape")
    text = value.decode("utf-8", "replace")
    text = _CONTROL.sub(lambda m: "\\x%02x" % ord(m.group()), text)
    if len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text
