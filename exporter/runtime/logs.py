"""Log lines as the Prometheus ecosystem writes them (`--log.format=logfmt|json`).

logfmt as go-kit/log and Go's slog write it (`ts=2026-12-02T14:20:25.612Z level=info
logger=shmwatch msg="mount /dev/shm: inotify on"`), quoted and escaped so every line
parses; json: one object a line, same keys. Uncaught exceptions (threads too) as well.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time

_LEVELS = {"WARNING": "warn", "CRITICAL": "error"}
_ESCAPES = {chr(c): f"\\u{c:04x}" for c in [*range(0x20), 0x7F]}
_ESCAPES.update({"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"})
_QUOTED = re.compile(r'[ ="\\\x00-\x1f\x7f]')  # a value holding one of these is quoted
_ESCAPED = re.compile(r'["\\\x00-\x1f\x7f]')


def logfmt_value(value: object) -> str:
    text = str(value)
    if text and not _QUOTED.search(text):
        return text
    return '"' + _ESCAPED.sub(lambda m: _ESCAPES[m[0]], text) + '"'


class LineFormatter(logging.Formatter):
    """A record on one line: logfmt, or one JSON object with the same keys."""

    def __init__(self, json_lines: bool = False) -> None:
        super().__init__()
        self.json_lines = json_lines

    def format(self, record: logging.LogRecord) -> str:
        ms = int(record.created % 1 * 1000)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = {
            "ts": f"{ts}.{ms:03d}Z",
            "level": _LEVELS.get(record.levelname, record.levelname.lower()),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["err"] = self.formatException(record.exc_info)
        if self.json_lines:
            return json.dumps(fields)
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields.items())


def setup(level: str = "info", fmt: str = "logfmt", stream=None) -> None:
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(LineFormatter(json_lines=fmt == "json"))
    root = logging.getLogger()
    for old in list(
        root.handlers
    ):  # removed, not closed (as basicConfig's force would)
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper(), logging.INFO))
    logging.captureWarnings(True)  # warnings.warn() as log lines too
    log = logging.getLogger("shmwatch")

    def thread_hook(args) -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread else "?"
            exc_info = (args.exc_type, args.exc_value, args.exc_traceback)
            log.error("uncaught exception in thread %s", name, exc_info=exc_info)

    def main_hook(exc_type, exc_value, exc_traceback) -> None:
        log.error("uncaught exception", exc_info=(exc_type, exc_value, exc_traceback))

    threading.excepthook = thread_hook
    sys.excepthook = main_hook
