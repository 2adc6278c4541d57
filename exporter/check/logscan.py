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
from typing import Any, BinaryIO, Dict, Iterator, List, Optional, Sequence, Tuple

import yaml

from exporter.check.findings import MiB, Bounded, Report, human
from exporter.check.names import shown

SIGNATURES = resources.files(__package__).joinpath("signatures.yml")
# name -> its needles, regex, explanation and remedy, each quoted from the library that prints it
TABLE: Dict[str, Dict[str, Any]] = yaml.safe_load(SIGNATURES.read_text("utf-8"))
PATTERNS = [(name, re.compile(said["regex"])) for name, said in TABLE.items()]
# Sought per chunk by bytes.find (100x faster than regexes); PATTERNS see text near one.
NEEDLES = tuple(dict.fromkeys(n.encode() for v in TABLE.values() for n in v["needles"]))
# The tail: recent failures matter; a line over CHUNK is matched in CHUNK-sized pieces.
MAX_LOG_BYTES, CHUNK = 64 << 20, 1 << 20
# Bytes either side of a needle's hit that the regexes see: every signature's quantifiers are
# bounded, so that a match, and its needle, fit in WINDOW // 2 (tests/system/test_check.py checks).
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
        scan = LogScan(hits={}, size=info.st_size, start=start, end=start)
        handle.seek(start)
        counts = _scan_tail(path, handle, scan, deadline)
    for name, n in counts.items():
        scan.hits[name].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return scan


@dataclass(frozen=True)
class _Piece:
    """Whole lines of the log (or a piece of a line longer than CHUNK, or what is left at
    its end), and the offset of its first byte."""

    data: bytes
    base: int


@dataclass
class _Tail:
    """Where reading a log's tail is: bytes read, a line begun and not ended, lines before."""

    read: int  # the offset read up to
    carry: bytes = b""  # the last line of what was read, not ended yet
    lines: int = 0  # lines before the next piece (counted from the log's start)

    def take(self, block: bytes, scan: LogScan) -> _Piece:
        """The next piece to match, with `block` just read; the line the tail begins in the
        middle of is left out."""
        self.read += len(block)
        data, base = self.carry + block, scan.end
        cut = data.rfind(b"\n") + 1 if block and self.read < scan.size else len(data)
        cut = cut or len(data)
        piece, self.carry = data[:cut], data[cut:]
        if base == scan.start and scan.start:
            skip = piece.find(b"\n") + 1 or len(piece)
            piece, base = piece[skip:], base + skip
        return _Piece(data=piece, base=base)


def _scan_tail(
    path: str, handle: BinaryIO, scan: LogScan, deadline: float
) -> "Counter[str]":
    """Reads `scan`'s bytes by CHUNK, matching each piece; -> lines matched by signature."""
    counts: Counter[str] = Counter()
    tail = _Tail(read=scan.start)
    while scan.end < scan.size and time.monotonic() < deadline:
        block = handle.read(min(CHUNK, scan.size - tail.read))
        piece = tail.take(block, scan)
        stopped_at = _match(path, piece, tail.lines, scan, counts, deadline)
        if stopped_at is not None:
            scan.end = stopped_at
        else:
            scan.end = piece.base + len(piece.data)
            tail.lines += piece.data.count(b"\n")
        if not block:
            break  # truncated while read
    return counts


def _match(
    path: str,
    piece: _Piece,
    lines: int,
    scan: LogScan,
    counts: "Counter[str]",
    deadline: float,
) -> Optional[int]:
    """Each signature's first hit in `piece` into `scan`; -> the offset the deadline stopped
    it at, or None when the piece was matched whole."""
    for candidate in _candidates(piece.data, lines):
        if time.monotonic() >= deadline:
            return piece.base + candidate.offset
        number = None if scan.start else candidate.line
        for found in _matches(candidate.texts):
            counts[found.signature] += 1
            hit = LogHit(
                file=path,
                line=number,
                offset=piece.base + candidate.offset,
                text=found.text,
                fields=found.fields,
            )
            scan.hits.setdefault(found.signature, hit)
    return None


@dataclass(frozen=True)
class _Found:
    signature: str
    text: str  # the text near its match, quoted
    fields: Dict[str, str]  # its named groups, quoted


def _matches(texts: List[str]) -> Iterator[_Found]:
    """Each signature `texts` match, with its first match."""
    for name, pattern in PATTERNS:
        match = next(filter(None, map(pattern.search, texts)), None)
        if match:
            fields = {  # quoted in the explanation: a size in MiB as a reading
                k: human(float(v) * MiB) if k.endswith("_mib") else shown(v[:100])
                for k, v in match.groupdict().items()
            }
            text = shown(match.string[max(0, match.start() - 100) :], 300)
            yield _Found(signature=name, text=text, fields=fields)


@dataclass(frozen=True)
class _Candidate:
    offset: int  # of the line in its piece
    line: int  # its number in the log
    texts: List[str]  # the stretches within WINDOW of a needle in it


Span = Tuple[int, int]  # [start, stop) in a piece


def _candidates(piece: bytes, lines: int) -> Iterator[_Candidate]:
    """Each line of `piece` with a needle, and the stretches within WINDOW of one (no regex
    scans the rest); `lines`: lines before `piece`."""
    near = _near_needles(piece.lower())
    at, number = 0, lines + 1
    for begin, end in sorted(near):
        number, at = number + piece.count(b"\n", at, begin), begin
        # a byte that is not UTF-8 stays itself, for `shown` to spell it (\xff)
        texts = [
            piece[a:b].decode("utf-8", "surrogateescape").strip()
            for a, b in _merged(near[begin, end])
        ]
        yield _Candidate(offset=begin, line=number, texts=texts)


def _near_needles(low: bytes) -> Dict[Span, List[Span]]:
    """The line (begin, end) of each needle's hit in `low` -> the stretches around its hits."""
    near: Dict[Span, List[Span]] = {}
    for needle in NEEDLES:
        i, end = low.find(needle), -1
        spans: List[Span] = []
        while i != -1:
            if i >= end:  # a line not seen yet
                begin, end = low.rfind(b"\n", 0, i) + 1, low.find(b"\n", i)
                end = len(low) if end == -1 else end
                spans = near.setdefault((begin, end), [])
            spans.append((max(begin, i - WINDOW), min(end, i + WINDOW)))
            # a hit closer than WINDOW // 2 has its match within this hit's stretch
            i = low.find(needle, min(i + WINDOW // 2, end))
    return near


def _merged(spans: List[Span]) -> List[Span]:
    """Overlapping stretches as one."""
    merged: List[Span] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], stop))
        else:
            merged.append((start, stop))
    return merged


def refusal(path: str) -> str:
    """Why --log's `path` is not read: only a readable regular file is, as in scan_log."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return "not a regular file"
    except OSError as err:
        return f"cannot read it: {err.strerror}"
    return "" if os.access(path, os.R_OK) else "cannot read it"


def _unread(report: Report, name: str, scan: LogScan) -> None:
    """What of a log was not read: before its tail, or past the deadline."""
    tail, size = scan.size - scan.start, scan.size
    if scan.start:
        text = f"only its last {human(tail)} of {human(size)} read"
        report.add("info", "log", name, text)
    if scan.end < size:
        read = f"{human(scan.end - scan.start)} of {human(tail)} read"
        text = f"not read to its end within --timeout: {read}"
        report.add("warn", "log", name, text)


def log_findings(
    report: Report, scans: Sequence[Tuple[str, Bounded[LogScan]]], deadline: float
) -> None:
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
        _unread(report, name, scan)
    for signature, hit in hits.items():
        where = shown(os.path.basename(hit.file))
        where += f":{hit.line}" if hit.line else f" at byte {hit.offset}"
        said, fields = TABLE[signature], hit.fields
        text = said["explanation"].format_map(fields) + f" Seen: {hit.text}"
        report.add("warn", "log", where, text, said["remedy"].format_map(fields))
