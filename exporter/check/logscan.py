"""Known failure signatures in server logs: shared memory, SysV, SIGBUS, CUDA OOM.

`shmwatch check --log FILE` streams a log through these; each signature's format is
quoted from the library that prints it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List

# Each: (name, regex, explanation, remedy).
SIGNATURES = (
    # NCCL src/misc/shmutils.cc: "Error while creating shared memory segment /dev/shm/nccl-XXXXXX
    # (size N), error: No space left on device (28)"; older builds: "include/shm.h ... Error while
    # creating shared memory segment nccl-shm-recv-... (size N)".
    (
        "nccl_shm_create",
        r"NCCL WARN Error while (creating|attaching to) shared memory segment (\S+)",
        "NCCL could not create or attach a shared-memory segment: /dev/shm is too small or full.",
        "raise the shm size (--shm-size / shm_size / emptyDir sizeLimit) or remove leaked nccl-* segments; "
        "NCCL_SHM_DISABLE=1 only as a last resort",
    ),
    # NCCL shmutils.cc: "Error: failed to extend /dev/shm/nccl-XXXXXX to N bytes"; NCCL <= 2.11
    # include/shm.h: "Call to posix_fallocate failed : No space left on device".
    (
        "nccl_shm_extend",
        r"failed to extend (/dev/shm/nccl-\S+)|Call to posix_fallocate failed",
        "NCCL ran out of /dev/shm while sizing a segment.",
        "raise the shm size; Docker's 64 MiB default is far too small for NCCL",
    ),
    # UCX src/ucs/sys/sys.c: "shmget(size=N flags=0x7b0) for mm_recv_desc failed: No space left on
    # device, please check shared memory limits by 'ipcs -l'"
    (
        "ucx_shmget",
        r"shmget\(size=(\d+) flags=0x[0-9a-f]+\) for \S+ failed: (No space left on device|"
        r"Cannot allocate memory|Operation not permitted|Invalid argument)",
        "UCX's SysV transport hit a SysV shared-memory limit (kernel.shmmni / shmall / shmmax).",
        "ipcs -m and ipcrm -m <id> for orphans; sysctl kernel.shmmni / kernel.shmall; or UCX_TLS without sysv",
    ),
    # UCX src/uct/sm/mm/posix: "Not enough memory to write total of N bytes. Please check that
    # /dev/shm or the directory you specified has more available memory."
    (
        "ucx_posix",
        r"Not enough memory to write total of (\d+) bytes",
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
    # vLLM's shm checks before starting workers.
    (
        "vllm_insufficient_shm",
        r"(?i)Insufficient space in /dev/shm",
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
        r"resource_tracker: There appear to be (\d+) leaked shared_memory objects",
        "Python's resource tracker found shared_memory segments nobody unlinked: a process exited uncleanly.",
        "check /dev/shm for leftover psm_* segments and remove them",
    ),
)


PATTERNS = [(name, re.compile(regex)) for name, regex, _, _ in SIGNATURES]


@dataclass
class LogHit:
    file: str
    line: int
    text: str  # the line, and how many lines matched when more than one


def scan_log(path: str) -> Dict[str, List[LogHit]]:
    """signature name -> [its first hit]. Streams the log line by line (large logs are never
    loaded whole)."""
    hits: Dict[str, List[LogHit]] = {}
    counts: Dict[str, int] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.decode("utf-8", "replace").strip()
            for name, pattern in PATTERNS:
                if pattern.search(line):
                    counts[name] = counts.get(name, 0) + 1
                    hits.setdefault(name, [LogHit(path, number, line[:300])])
    for name, n in counts.items():
        hits[name][0].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return hits
