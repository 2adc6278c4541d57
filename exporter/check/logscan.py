"""Known failure signatures in server logs: shared memory, SysV, SIGBUS, CUDA OOM.

`shmwatch check --log FILE` streams a log through these; each signature's format is
quoted from the library that prints it. A signature's named groups fill the {fields} of its
explanation and remedy (a group named *_mib is a MiB figure, shown by check's formatter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Dict, List

from exporter.check.sizes import human

# Each: (name, regex, explanation, remedy).
SIGNATURES = (
    # NCCL src/misc/shmutils.cc: "Error while creating shared memory segment /dev/shm/nccl-XXXXXX
    # (size N), error: No space left on device (28)"; older builds: "include/shm.h ... Error while
    # creating shared memory segment nccl-shm-recv-... (size N)".
    (
        "nccl_shm_create",
        r"NCCL WARN Error while (creating|attaching to) shared memory segment (\S+)(?!\S| \(size 0\))",
        "NCCL could not create or attach a shared-memory segment: /dev/shm is too small or full.",
        "raise the shm size (--shm-size / shm_size / emptyDir sizeLimit) or remove leaked nccl-* segments; "
        "NCCL_SHM_DISABLE=1 only as a last resort",
    ),
    # NCCL >= 2.26.3 puts its SHM transport in cuMem host memory when the probe succeeds: a
    # rank that did not (NCCL_CUMEM_HOST_ENABLE=0, an older NCCL) looks for a file the peer never
    # made: "Error while attaching to shared memory segment /dev/shm/nccl-XXXX (size 0)".
    (
        "nccl_cumem_mismatch",
        r"Error while attaching to shared memory segment (?P<segment>\S+) \(size 0\)",
        "NCCL ranks disagree about cuMem host memory: {segment} was never made as a file "
        "(its creator used cuMem host memory, NCCL >= 2.26.3), so the peer attached nothing.",
        "the same NCCL version and NCCL_CUMEM_HOST_ENABLE on every rank (0 puts the buffers "
        "back in /dev/shm files)",
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
    # vLLM MessageQueue (distributed/device_communicators/shm_broadcast.py) checks free space:
    # "RuntimeError: Insufficient space in /dev/shm: 160 MiB required, 64 MiB free. Increase
    # /dev/shm (e.g. --shm-size or --ipc=host)."
    (
        "vllm_shm_required",
        r"Insufficient space in /dev/shm: (?P<need_mib>\d+(?:\.\d+)?) MiB required, "
        r"(?P<free_mib>\d+(?:\.\d+)?) MiB free",
        "vLLM's shared-memory queue needs {need_mib} in /dev/shm and found {free_mib} free "
        "(Docker's 64 MiB default, or segments leaked by a crashed run).",
        "give /dev/shm more than {need_mib} (--shm-size, --ipc=host, an emptyDir of medium "
        "Memory) or remove leaked segments (shmwatch check lists them)",
    ),
    # vLLM shm_broadcast.py: "No available shared memory broadcast block found in 60 seconds"
    # (readers did not free a block: a rank hangs or is busy, e.g. compiling).
    (
        "vllm_broadcast_block",
        r"No available shared memory broadcast block found in (?P<seconds>\d+) seconds?",
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
        r"Rank (?P<rank>\d+) scheduler died during initialization \(exit code: (?P<code>-?\d+)\)",
        "SGLang's rank {rank} scheduler died while starting (exit code {code}; -7 is SIGBUS: "
        "a /dev/shm page could not be backed).",
        "raise the shm size (--shm-size / --ipc=host) and remove leaked sgl_shm_* and psm_* segments",
    ),
    # Ray: "store_runner.cc:83: System memory request exceeds memory available in /dev/shm" and
    # "The configured object store size (X GB) exceeds /dev/shm size (Y GB)".
    (
        "ray_object_store",
        r"System memory request exceeds memory available in /dev/shm|"
        r"The configured object store size .*exceeds /dev/shm size",
        "Ray's object store does not fit in /dev/shm (it falls back to /tmp, much slower).",
        "raise /dev/shm above --object-store-memory (--shm-size) or lower the object store",
    ),
    # kubelet eviction, as `kubectl describe pod` shows it: 'Usage of EmptyDir volume "dshm"
    # exceeds the limit "1Gi".'
    (
        "emptydir_evicted",
        r'Usage of EmptyDir volume "(?P<volume>[^"]*)" exceeds the limit "(?P<limit>[^"]*)"',
        "The kubelet evicted the pod: emptyDir {volume} grew past its sizeLimit {limit} (the "
        "tmpfs may be larger than the limit: the kubelet enforces it by eviction).",
        "raise sizeLimit of {volume} (and the memory limit with it) or find what filled it "
        "(shmwatch_top_segment_bytes)",
    ),
    # vLLM's older shm checks, worded otherwise.
    (
        "vllm_insufficient_shm",
        r"(?i)Insufficient space in /dev/shm(?!: [\d.]+ MiB required)",
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
    fields: Dict[str, str] = field(default_factory=dict)  # the first hit's named groups


def scan_log(path: str) -> Dict[str, List[LogHit]]:
    """signature name -> [its first hit]. Streams the log line by line (large logs are never
    loaded whole)."""
    hits: Dict[str, List[LogHit]] = {}
    counts: Dict[str, int] = {}
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, 1):
            line = raw.decode("utf-8", "replace").strip()
            for name, pattern in PATTERNS:
                match = pattern.search(line)
                if match:
                    counts[name] = counts.get(name, 0) + 1
                    if name not in hits:
                        hits[name] = [LogHit(path, number, line[:300], _fields(match))]
    for name, n in counts.items():
        hits[name][0].text += f"  [{n} matching line(s)]" if n > 1 else ""
    return hits


def _fields(match: "re.Match[str]") -> Dict[str, str]:
    out = {}
    for name, text in match.groupdict().items():
        if name.endswith("_mib"):
            text = human(float(text) * 2**20)
        out[name] = text[:100]
    return out
