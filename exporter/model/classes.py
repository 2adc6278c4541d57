"""Who made this segment? Basename pattern -> owner class; the first matching row wins:
PSM's psm_shm.* and PSM2's psm2_shm.* are MPI transports: before python_shm's psm_*."""

import functools
import re
from dataclasses import dataclass
from typing import Dict, Pattern, Tuple


@dataclass(frozen=True)
class ClassRule:
    """A row of the class table: a basename that `pattern` matches whole is of class `cls`."""

    cls: str
    pattern: str  # a regular expression on the basename
    source: str  # where such names come from (docs/check.md's table shows it)


CLASSES: Tuple[ClassRule, ...] = (
    ClassRule(
        cls="mpi",
        pattern=r"vader_segment\..*",
        source="Open MPI vader/sm BTL: vader_segment.<host>.<...>",
    ),
    ClassRule(
        cls="mpi",
        pattern=r"sm_segment\..*",
        source="Open MPI 5 sm BTL (vader renamed)",
    ),
    ClassRule(
        cls="mpi",
        pattern=r"mpich_shar_tmp.*",
        source="MPICH shared-memory temp files",
    ),
    ClassRule(
        cls="mpi",
        pattern=r"shm-col-space.*",
        source="Intel MPI / MPICH collectives",
    ),
    ClassRule(
        cls="mpi",
        pattern=r"psm_shm\..*",
        source="Intel PSM (InfiniPath) shared memory",
    ),
    ClassRule(
        cls="mpi",
        pattern=r"psm2_shm\..*",
        source="Intel PSM2 (Omni-Path) shared memory",
    ),
    ClassRule(
        cls="nccl",
        pattern=r"nccl-.*",
        source="NCCL: nccl-XXXXXX (<= 2.11: nccl-shm-recv-*, -send-*)",
    ),
    ClassRule(
        cls="ucx",
        pattern=r"ucx_shm_posix_.*",
        source="UCX posix transport (uct/sm/mm/posix)",
    ),
    ClassRule(
        cls="torch",
        pattern=r"torch_.*",
        source="PyTorch file_system sharing: torch_<pid>_<rand>[_<n>]",
    ),
    ClassRule(
        cls="python_shm",
        pattern=r"psm_.*",
        source="multiprocessing.shared_memory (vLLM/SGLang queues)",
    ),
    ClassRule(
        cls="sglang",
        pattern=r"sgl_shm_.*",
        source="SGLang: sgl_shm_<kind>_<pid>_<rand> (multimodal sgl_shm_mm_*)",
    ),
    ClassRule(
        cls="sglang",
        pattern=r"sglang_loads_.*",
        source="SGLang: sglang_loads_* (expert load statistics)",
    ),
    ClassRule(
        cls="semaphore",
        pattern=r"sem\.loky-.*",
        source="joblib/loky semaphores: sem.loky-<pid>-<rand>",
    ),
    ClassRule(
        cls="semaphore",
        pattern=r"sem\..*",
        source="glibc sem_open(): /dev/shm/sem.<name>",
    ),
    # Unlinked once every worker mapped it (vLLM PR 52596): then a hidden segment.
    ClassRule(
        cls="vllm_offload",
        pattern=r"vllm_offload_.*",
        source="vLLM CPU KV offload: vllm_offload_<uuid>.mmap",
    ),
    ClassRule(
        cls="ray",
        pattern=r"plasma.*",
        source="Ray plasma object store",
    ),
    ClassRule(
        cls="nixl",
        pattern=r"nixl_.*",
        source="NVIDIA NIXL (disaggregated KV transfer)",
    ),
    ClassRule(
        cls="dali",
        pattern=r"nvidia_dali_.*",
        source="NVIDIA DALI shared memory",
    ),
    ClassRule(
        cls="triton",
        pattern=r"triton_python_backend_shm_region_.*",
        source="Triton python backend",
    ),
    ClassRule(
        cls="cuda",
        pattern=r"cuda\.shm\..*",
        source="CUDA IPC / MPS: cuda.shm.<pid>.<n>",
    ),
)

CLASS_NAMES: Tuple[str, ...] = (*dict.fromkeys(rule.cls for rule in CLASSES), "other")

# One alternation, one fullmatch per name: the first row that matches names its group.
_COMBINED: Pattern[str] = re.compile(
    "|".join(f"(?P<r{i}>{rule.pattern})" for i, rule in enumerate(CLASSES)), re.S
)
_GROUP_CLASS: Dict[str, str] = {f"r{i}": rule.cls for i, rule in enumerate(CLASSES)}


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
