"""Label values from file and process names, which can be any bytes of any length (what a
process passed to shm_open()): not UTF-8 becomes U+FFFD, control characters \\xNN (a raw
carriage return or escape sequence breaks dashboards and terminals), and the length is
capped so one hostile name cannot bloat every scrape."""

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
