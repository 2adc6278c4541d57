"""Known failure signatures in server logs: shared memory, SysV, SIGBUS, CUDA OOM.

`shmwatch check --log FILE` reads a log's tail through these, in bounded memory and time;
each signature's format is quoted from the library that prints it. A signature's named groups
fill the {fields} of its explanation and remedy (a group named *_mib is a MiB figure, shown by
check's formatter).
"""

from __future__ import annotations

import math
import os
import re
import stat
import time
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

from exporter.check.findings import quoted

from exporter.check.sizes import human

# Each: (name, regex, explanation, remedy).
SIGNATURES = (
    # NCCL src/misc/shmutils.cc: "Error while creating shared memory segment /dev/shm/nccl-XXXXXX
    # (size N), error: No space left on device (28)"; older builds: "include/shm.h ... Error while
    # creating shared memory segment nccl-shm-recv-... (size N)".
    (
        "nccl_shm_create",
        r"NCCL WARN Error while (creating|attaching to) shared memory segment (\S{1,300})(?!\S| \(size 0\))",
        "NCCL could not create or attach a shared-memory segment: /dev/shm is too small or full.",
        "raise the shm size (--shm-size / shm_size / emptyDir sizeLimit) or remove leaked nccl-* segments; "
        "NCCL_SHM_DISABLE=1 only as a last resort",
    ),
    # NCCL >= 2.26.3 puts its SHM transport in cuMem host memory when the probe succeeds: a
    # rank that did not (NCCL_CUMEM_HOST_ENABLE=0, an older NCCL) looks for a file the peer never
    # made: "Error while attaching to shared memory segment /dev/shm/nccl-XXXX (size 0)".
    (
        "nccl_cumem_mismatch",
        r"Error while attaching to shared memory segment (?P<segment>\S{1,300}) \(size 0\)",
        "NCCL ranks disagree about cuMem host memory: {segment} was never made as a file "
        "(its creator used cuMem host memory, NCCL >= 2.26.3), so the peer attached nothing.",
        "the same NCCL version and NCCL_CUMEM_HOST_ENABLE on every rank (0 puts the buffers "
        "back in /dev/shm files)",
    ),
    # NCCL shmutils.cc: "Error: failed to extend /dev/shm/nccl-XXXXXX to N bytes"; NCCL <= 2.11
    # include/shm.h: "Call to posix_fallocate failed : No space left on device".
    (
        "nccl_shm_extend",
        r"failed to extend (/dev/shm/nccl-\S{1,300})|Call to posix_fallocate failed",
        "NCCL ran out of /dev/shm while sizing a segment.",
        "raise the shm size; Docker's 64 MiB default is far too small for NCCL",
    ),
    # UCX src/ucs/sys/sys.c: "shmget(size=N flags=0x7b0) for mm_recv_desc failed: No space left on
    # device, please check shared memory limits by 'ipcs -l'"
    (
        "ucx_shmget",
        r"shmget\(size=(\d{1,20}) flags=0x[0-9a-f]{1,16}\) for \S{1,100} failed: (No space left on device|"
        r"Cannot allocate memory|Operation not permitted|Invalid argument)",
        "UCX's SysV transport hit a SysV shared-memory limit (kernel.shmmni / shmall / shmmax).",
        "ipcs -m and ipcrm -m <id> for orphans; sysctl kernel.shmmni / kernel.shmall; or UCX_TLS without sysv",
    ),
    # UCX src/uct/sm/mm/posix: "Not enough memory to write total of N bytes. Please check that
    # /dev/shm or the directory you specified has more available memory."
    (
        "ucx_posix",
        r"Not enough memory to write total of (\d{1,20}) bytes",
        "UCX's posix transport could not size a segment in /dev/shm.",
        "raise the shm size",
    ),
    # Generic wording used by several runtimes (DALI, Triton python backend, custom allocators).
    (
        "shm_alloc",
        r"(?i)Failed to allocate shared memory",
        "A shared-memory allocation failed.",
        "check /dev/shm size and use; raise it or remove leaked segments",
    ),
    # vLLM MessageQueue (distributed/device_communicators/shm_broadcast.py) checks free space:
    # "RuntimeError: Insufficient space in /dev/shm: 160 MiB required, 64 MiB free. Increase
    # /dev/shm (e.g. --shm-size or --ipc=host)."
    (
        "vllm_shm_required",
        r"Insufficient space in /dev/shm: (?P<need_mib>\d{1,20}(?:\.\d{1,9})?) MiB required, "
        r"(?P<free_mib>\d{1,20}(?:\.\d{1,9})?) MiB free",
        "vLLM's shared-memory queue needs {need_mib} in /dev/shm and found {free_mib} free "
        "(Docker's 64 MiB default, or segments leaked by a crashed run).",
        "give /dev/shm more than {need_mib} (--shm-size, --ipc=host, an emptyDir of medium "
        "Memory) or remove leaked segments (shmwatch check lists them)",
    ),
    # vLLM shm_broadcast.py: "No available shared memory broadcast block found in 60 seconds"
    # (readers did not free a block: a rank hangs or is busy, e.g. compiling).
    (
        "vllm_broadcast_block",
        r"No available shared memory broadcast block found in (?P<seconds>\d{1,20}) seconds?",
        "vLLM's broadcast queue found no free block for {seconds} s: a worker stopped reading "
        "(hung, dead, or busy compiling), not a full /dev/shm.",
        "look at the workers' logs for a hang or crash (py-spy dump); a larger /dev/shm does not help",
    ),
    # vLLM v1: "EngineDeadError: EngineCore encountered an issue. See stack trace (above) ...",
    # after a "Bus error" when a worker touched a /dev/shm page tmpfs could not back.
    (
        "vllm_engine_dead",
        r"EngineDeadError: EngineCore encountered an issue",
        "vLLM's engine core died; a Bus error before it means /dev/shm filled while in use.",
        "find the first error above it; after a Bus error raise the shm size",
    ),
    # SGLang launch: "RuntimeError: Rank 0 scheduler died during initialization (exit code: -7)",
    # after "Fatal Python error: Bus error" (-7: killed by SIGBUS).
    (
        "sglang_scheduler_died",
        r"Rank (?P<rank>\d{1,20}) scheduler died during initialization \(exit code: (?P<code>-?\d{1,20})\)",
        "SGLang's rank {rank} scheduler died while starting (exit code {code}; -7 is SIGBUS: "
        "a /dev/shm page could not be backed).",
        "raise the shm size (--shm-size / --ipc=host) and remove leaked sgl_shm_* and psm_* segments",
    ),
    # Ray: "store_runner.cc:83: System memory request exceeds memory available in /dev/shm" and
    # "The configured object store size (X GB) exceeds /dev/shm size (Y GB)".
    (
        "ray_object_store",
        r"System memory request exceeds memory available in /dev/shm|"
        r"The configured object store size .{0,100}exceeds /dev/shm size",
        "Ray's object store does not fit in /dev/shm (it falls back to /tmp, much slower).",
        "raise /dev/shm above --object-store-memory (--shm-size) or lower the object store",
    ),
    # kubelet eviction, as `kubectl describe pod` shows it: 'Usage of EmptyDir volume "dshm"
    # exceeds the limit "1Gi".'
    (
        "emptydir_evicted",
        r'Usage of EmptyDir volume "(?P<volume>[^"]{0,256})" exceeds the limit "(?P<limit>[^"]{0,64})"',
        "The kubelet evicted the pod: emptyDir {volume} grew past its sizeLimit {limit} (the "
        "tmpfs may be larger than the limit: the kubelet enforces it by eviction).",
        "raise sizeLimit of {volume} (and the memory limit with it) or find what filled it "
        "(shmwatch_top_segment_bytes)",
    ),
    # vLLM's older shm checks, worded otherwise.
    (
        "vllm_insufficient_shm",
        r"(?i)Insufficient space in /dev/shm(?!: [\d.]{1,30} MiB required)",
        "vLLM found too little free space in /dev/shm (often leaked segments from a crashed run).",
        "remove leaked segments (shmwatch check lists them) or raise the shm size",
    ),
    # SIGBUS: a process touched a page of a tmpfs file that tmpfs could not back. PyTorch's
    # DataLoader says "Unexpected bus error encountered in worker. This might be caused by
    # insufficient shared memory (shm)"; a plain process dies with "Bus error (core dumped)".
    (
        "bus_error",
        r"(?i)Bus error|bus error encountered in worker",
        "SIGBUS: a mapped shm page could not be backed — /dev/shm filled while in use.",
        "raise the shm size; find what filled it with shmwatch_top_segment_bytes",
    ),
    # PyTorch: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB";
    # CUDA runtime: "CUDA error: out of memory".
    (
        "cuda_oom",
        r"CUDA out of memory|CUDA error: out of memory",
        "The GPU ran out of memory (not shared memory).",
        "lower --gpu-memory-utilization / max batch or context; check other GPU processes",
    ),
    # CPython multiprocessing/resource_tracker.py: "resource_tracker: There appear to be N leaked
    # shared_memory objects to clean up at shutdown"
    (
        "leaked_shared_memory",
        r"resource_tracker: There appear to be (\d{1,20}) leaked shared_memory objects",
        "Python's resource tracker found shared_memory segments nobody unlinked: a process exited uncleanly.",
        "check /dev/shm for leftover psm_* segments and remove them",
    ),
)


PATTERNS = [(name, re.compile(regex)) for name, regex, _, _ in SIGNATURES]
# Lower-case words one of which every signature's line holds: each chunk of a log is searched
# for these (bytes.find, a hundred times faster than the regexes), and only the text near one
# is matched against SIGNATURES.
NEEDLES = (
    b"nccl warn error while",
    b"failed to extend /dev/shm/nccl-",
    b"call to posix_fallocate failed",
    b"shmget(size=",
    b"not enough memory to write total of",
    b"failed to allocate shared memory",
    b"insufficient space in /dev/shm",
    b"bus error",
    b"cuda out of memory",
    b"cuda error: out of memory",
    b"leaked shared_memory objects",
    b"error while attaching to shared memory segment",
    b"no available shared memory broadcast block",
    b"enginedeaderror",
    b"scheduler died during initialization",
    b"exceeds memory available in /dev/shm",
    b"exceeds /dev/shm size",
    b"usage of emptydir volume",
)
# At most the last MAX_LOG_BYTES of a log are read (a server's recent failures are the ones
# that matter), CHUNK at a time; a line longer than CHUNK is matched in pieces of that size.
MAX_LOG_BYTES, CHUNK = 64 << 20, 1 << 20
# Bytes either side of a needle's hit that the regexes see: every signature's quantifiers are
# bounded, so that a match, and its needle, fit in WINDOW // 2 (tests/test_check.py checks).
WINDOW = 1 << 10


@dataclass
class LogHit:
    file: str
    # None when the log was read from its tail, not its start: then `offset` says where
    line: Optional[int]
    offset: int  # of the line's first byte
    text: str  # the line, and how many lines matched when more than one
    fields: Dict[str, str] = field(default_factory=dict)  # the first hit's named groups


@dataclass
class LogScan:
    """What was read of one log: bytes [start, end) of the `size` it had when opened."""

    hits: Dict[str, List[LogHit]]
    size: int
    start: int
    end: int


def scan_log(path: str, deadline: float = math.inf) -> LogScan:
    """signature name -> [its first hit], from the log's last MAX_LOG_BYTES, read CHUNK at a
    time until its size when opened or `deadline` (time.monotonic()). Only a regular file is
    read (ValueError otherwise): a FIFO with no writer would block, a device never ends."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    with open(fd, "rb", buffering=0) as handle:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError("not a regular file")
        start = max(0, info.st_size - MAX_LOG_BYTES)
        scan = LogScan({}, info.st_size, start, start)
        handle.seek(start)
        counts: Dict[str, int] = {}
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
                _match(scan, counts, texts, LogHit(path, number, base + offset, ""))
            else:
                scan.end, lines = base + len(piece), lines + piece.count(b"\n")
            if not block:
                break  # truncated while read
    for name, n in counts.items():
        scan.hits[name][0].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return scan


def _match(
    scan: LogScan, counts: Dict[str, int], texts: List[str], where: LogHit
) -> None:
    """Each signature one of a line's `texts` matches counts once; its first hit is kept
    (`where`, with the text quoted around where it matched)."""
    for name, pattern in PATTERNS:
        match = next(filter(None, map(pattern.search, texts)), None)
        if match:
            counts[name] = counts.get(name, 0) + 1
            at = max(0, match.start() - 100)  # a long line: where it matched
            text_at = quoted(match.string[at:], 300)
            hit = LogHit(where.file, where.line, where.offset, text_at, _fields(match))
            scan.hits.setdefault(name, [hit])


def _candidates(piece: bytes, lines: int) -> Iterator[Tuple[int, int, List[str]]]:
    """(offset, line number, texts) of each line in `piece` holding one of NEEDLES; texts: its
    stretches within WINDOW bytes of a needle, where every signature's match lies, so that no
    regex runs over the rest of a long line. `lines`: how many lines came before `piece`."""
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
        texts = [piece[a:b].decode("utf-8", "replace").strip() for a, b in merged]
        yield begin, number, texts


def _fields(match: "re.Match[str]") -> Dict[str, str]:
    out = {}
    for name, text in match.groupdict().items():
        if name.endswith("_mib"):
            text = human(float(text) * 2**20)
        out[name] = text[:100]
    return out
