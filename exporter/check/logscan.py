"""`shmwatch check --log`: signatures.yml's failures (shm, SysV, SIGBUS, CUDA OOM) found
in a server log's tail, in bounded memory and time, and what could not be read."""

import math
import os
import re
import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from importlib import resources
from typing import Dict, Iterator, List, Optional, Tuple

import yaml

from exporter.check.findings import MiB, Report, human
from exporter.check.names import shown

SIGNATURES = resources.files(__package__).joinpath("signatures.yml")
# name -> its needles, regex, explanation and remedy, each quoted from the library that prints it
TABLE = yaml.safe_load(SIGNATURES.read_text("utf-8"))
PATTERNS = [(name, re.compile(said["regex"])) for name, said in TABLE.items()]
# Sought per chunk by bytes.find (100x faster than regexes); PATTERNS see text near one.
NEEDLES = tuple(dict.fromkeys(n.encode() for v in TABLE.values() for n in v["needles"]))
# The tail: recent failures matter; a line over CHUNK is matched in CHUNK-sized pieces.
MAX_LOG_BYTES, CHUNK = 64 << 20, 1 << 20
# Bytes either side of a needle's hit that the regexes see: every signature's quantifiers are
# bounded, so that a match, and its needle, fit in WINDOW // 2 (tests/test_check.py checks).
WINDOW = 1 << 10


@dataclass
class LogHit:
    file: str
    line: Optional[int]  # None when read from its tail, not its start: see `offset`
    offset: int  # of the line's first byte
    text: str  # the line, and how many lines matched when more than one
    fields: Dict[str, str] = field(default_factory=dict)  # the first hit's named groups


@dataclass
class LogScan:
    """Bytes [start, end) read of the `size` the log had when opened; signature -> first hit."""

    hits: Dict[str, LogHit]
    size: int
    start: int
    end: int


def scan_log(path: str, deadline: float = math.inf) -> LogScan:
    """Last MAX_LOG_BYTES by CHUNK, to its size at open or `deadline` (monotonic).
    ValueError unless a regular file: a writerless FIFO blocks, a device never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with open(fd, "rb", buffering=0) as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        start = max(0, info.st_size - MAX_LOG_BYTES)
        scan, counts = LogScan({}, info.st_size, start, start), Counter()
        handle.seek(start)
        carry, lines, read = b"", 0, start
        while scan.end < scan.size and time.monotonic() < deadline:
            block = handle.read(min(CHUNK, scan.size - read))
            read += len(block)
            data, base = carry + block, scan.end
            # whole lines, a piece of a line longer than CHUNK, or what is left at the end
            cut = data.rfind(b"\n") + 1 if block and read < scan.size else len(data)
            piece, carry = data[: cut or len(data)], data[cut or len(data) :]
            if base == start and start:  # the line the tail begins in the middle of
                skip = piece.find(b"\n") + 1 or len(piece)
                piece, base = piece[skip:], base + skip
            for offset, line, texts in _candidates(piece, lines):
                if time.monotonic() >= deadline:
                    scan.end = base + offset
                    break
                number = None if start else line
                for name, text, fields in _matches(texts):
                    counts[name] += 1
                    hit = LogHit(path, number, base + offset, text, fields)
                    scan.hits.setdefault(name, hit)
            else:
                scan.end, lines = base + len(piece), lines + piece.count(b"\n")
            if not block:
                break  # truncated while read
    for name, n in counts.items():
        scan.hits[name].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return scan


def _matches(texts: List[str]) -> Iterator[Tuple[str, str, Dict[str, str]]]:
    """(signature, the text near its match, quoted, its named groups) per signature `texts` match."""
    for name, pattern in PATTERNS:
        match = next(filter(None, map(pattern.search, texts)), None)
        if match:
            fields = {  # quoted in the explanation: a size in MiB as a reading
                k: human(float(v) * MiB) if k.endswith("_mib") else shown(v[:100])
                for k, v in match.groupdict().items()
            }
            yield name, shown(match.string[max(0, match.start() - 100) :], 300), fields


def _candidates(piece: bytes, lines: int) -> Iterator[Tuple[int, int, List[str]]]:
    """(offset, line number, texts) per line of `piece` with a needle; texts: stretches
    within WINDOW of one (no regex scans the rest); `lines`: lines before `piece`."""
    low, near = piece.lower(), {}
    for needle in NEEDLES:
        i, end = low.find(needle), -1
        while i != -1:
            if i >= end:  # a line not seen yet
                begin, end = low.rfind(b"\n", 0, i) + 1, low.find(b"\n", i)
                end = len(low) if end == -1 else end
                spans = near.setdefault((begin, end), [])
            spans.append((max(begin, i - WINDOW), min(end, i + WINDOW)))
            # a hit closer than WINDOW // 2 has its match within this hit's stretch
            i = low.find(needle, min(i + WINDOW // 2, end))
    at, number = 0, lines + 1
    for begin, end in sorted(near):
        number, at = number + piece.count(b"\n", at, begin), begin
        merged: List[List[int]] = []
        for start, stop in sorted(near[begin, end]):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], stop)
            else:
                merged.append([start, stop])
        # a byte that is not UTF-8 stays itself, for `shown` to spell it (\xff)
        texts = [
            piece[a:b].decode("utf-8", "surrogateescape").strip() for a, b in merged
        ]
        yield begin, number, texts


def refusal(path: str) -> str:
    """Why --log's `path` is not read: only a readable regular file is, as in scan_log."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "not a regular file"
    except OSError as err:
        return f"cannot read it: {err.strerror}"
    return "" if os.access(path, os.R_OK) else "cannot read it"


def log_findings(report: Report, scans, deadline: float) -> None:
    """Signatures found by `deadline` (each once, first hit) and what was not read."""
    hits: Dict[str, LogHit] = {}
    for path, task in scans:
        name = shown(os.path.basename(path))
        try:
            scan = task.result(deadline)
        except (OSError, ValueError) as err:  # TimeoutError among them
            late = isinstance(err, TimeoutError)
            why = " within --timeout" if late else f": {shown(err)}"
            report.add("warn", "log", name, f"not read{why}")
            continue
        for signature, hit in scan.hits.items():
            hits.setdefault(signature, hit)
        tail, size = scan.size - scan.start, scan.size
        if scan.start:
            text = f"only its last {human(tail)} of {human(size)} read"
            report.add("info", "log", name, text)
        if scan.end < size:
            read = f"{human(scan.end - scan.start)} of {human(tail)} read"
            text = f"not read to its end within --timeout: {read}"
            report.add("warn", "log", name, text)
    for signature, hit in hits.items():
        where = shown(os.path.basename(hit.file))
        where += f":{hit.line}" if hit.line else f" at byte {hit.offset}"
        said, fields = TABLE[signature], hit.fields
        text = said["explanation"].format_map(fields) + f" Seen: {hit.text}"
        report.add("warn", "log", where, text, said["remedy"].format_map(fields))
