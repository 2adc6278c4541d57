"""Who made this segment? Basename pattern -> owner class; the first matching row wins:
PSM's psm_shm.* and PSM2's psm2_shm.* are MPI transports: before python_shm's psm_*."""

import functools
import re
from dataclasses import dataclass
from typing import Pattern, Tuple


@dataclass(frozen=True)
class SegmentClass:
    """One row of the table: segments whose basename matches `pattern` (whole) are `name`'s."""

    name: str
    pattern: str
    # Where names of this form come from.
    source: str


CLASSES: Tuple[SegmentClass, ...] = (
    SegmentClass(
        name="mpi",
        pattern=r"vader_segment\..*",
        source="Open MPI vader/sm BTL: vader_segment.<host>.<...>",
    ),
    SegmentClass(
        name="mpi",
        pattern=r"sm_segment\..*",
        source="Open MPI 5 sm BTL (vader renamed)",
    ),
    SegmentClass(
        name="mpi",
        pattern=r"mpich_shar_tmp.*",
        source="MPICH shared-memory temp files",
    ),
    SegmentClass(
        name="mpi",
        pattern=r"shm-col-space.*",
        source="Intel MPI / MPICH collectives",
    ),
    SegmentClass(
        name="mpi",
        pattern=r"psm_shm\..*",
        source="Intel PSM (InfiniPath) shared memory",
    ),
    SegmentClass(
        name="mpi",
        pattern=r"psm2_shm\..*",
        source="Intel PSM2 (Omni-Path) shared memory",
    ),
    SegmentClass(
        name="nccl",
        pattern=r"nccl-.*",
        source="NCCL: nccl-XXXXXX (<= 2.11: nccl-shm-recv-*, -send-*)",
    ),
    SegmentClass(
        name="ucx",
        pattern=r"ucx_shm_posix_.*",
        source="UCX posix transport (uct/sm/mm/posix)",
    ),
    SegmentClass(
        name="torch",
        pattern=r"torch_.*",
        source="PyTorch file_system sharing: torch_<pid>_<rand>[_<n>]",
    ),
    SegmentClass(
        name="python_shm",
        pattern=r"psm_.*",
        source="multiprocessing.shared_memory (vLLM/SGLang queues)",
    ),
    SegmentClass(
        name="sglang",
        pattern=r"sgl_shm_.*",
        source="SGLang: sgl_shm_<kind>_<pid>_<rand> (multimodal sgl_shm_mm_*)",
    ),
    SegmentClass(
        name="sglang",
        pattern=r"sglang_loads_.*",
        source="SGLang: sglang_loads_* (expert load statistics)",
    ),
    SegmentClass(
        name="semaphore",
        pattern=r"sem\.loky-.*",
        source="joblib/loky semaphores: sem.loky-<pid>-<rand>",
    ),
    SegmentClass(
        name="semaphore",
        pattern=r"sem\..*",
        source="glibc sem_open(): /dev/shm/sem.<name>",
    ),
    # Unlinked once every worker mapped it (vLLM PR 52596): then a hidden segment.
    SegmentClass(
        name="vllm_offload",
        pattern=r"vllm_offload_.*",
        source="vLLM CPU KV offload: vllm_offload_<uuid>.mmap",
    ),
    SegmentClass(
        name="ray",
        pattern=r"plasma.*",
        source="Ray plasma object store",
    ),
    SegmentClass(
        name="nixl",
        pattern=r"nixl_.*",
        source="NVIDIA NIXL (disaggregated KV transfer)",
    ),
    SegmentClass(
        name="dali",
        pattern=r"nvidia_dali_.*",
        source="NVIDIA DALI shared memory",
    ),
    SegmentClass(
        name="triton",
        pattern=r"triton_python_backend_shm_region_.*",
        source="Triton python backend",
    ),
    SegmentClass(
        name="cuda",
        pattern=r"cuda\.shm\..*",
        source="CUDA IPC / MPS: cuda.shm.<pid>.<n>",
    ),
)

CLASS_NAMES: Tuple[str, ...] = (*dict.fromkeys(row.name for row in CLASSES), "other")

# One alternation, one fullmatch per name: the first row that matches names its group.
_COMBINED: Pattern[str] = re.compile(
    "|".join(f"(?P<r{i}>{row.pattern})" for i, row in enumerate(CLASSES)), re.S
)
_GROUP_CLASS = {f"r{i}": row.name for i, row in enumerate(CLASSES)}


def _class_of(basename: str) -> str:
    match = _COMBINED.fullmatch(basename.removesuffix(" (deleted)"))
    if match is None or match.lastgroup is None:
        return "other"
    return _GROUP_CLASS[match.lastgroup]


# Bounded: names repeat between inventories, but churn (every NCCL init makes new random
# names) would grow an unbounded cache forever. Not a decorator: mutation testing skips those.
classify = functools.lru_cache(maxsize=4096)(_class_of)


# Orphans of these classes are not leaks: glibc's sem_open() semaphores are tiny and meant
# to outlive their creator. The ShmLeakedSegments rule excludes them too (class!="semaphore").
NOT_LEAKS = frozenset({"semaphore"})
# An orphan of these classes is removable: each segment belongs to one process (an NCCL
# rank's buffer, a torch tensor, a SharedMemory, a vLLM offload file, a UCX or MPI endpoint,
# an SGLang scheduler's buffer, which SGLang reclaims alike): once it is gone, nothing
# attaches again. `shmwatch check` advises `rm` for these only: never for `other` (a
# container engine's lock file is not ours to judge), nor for an `unverified` segment.
REMOVABLE = frozenset("nccl torch python_shm vllm_offload ucx mpi sglang".split())
