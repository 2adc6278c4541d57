"""Who made this segment? Basename pattern -> owner class; the first matching row wins:
PSM's psm_shm.* and PSM2's psm2_shm.* are MPI transports: before python_shm's psm_*."""

import functools
import re
from typing import Pattern, Tuple

# class, regex on the basename, where the name comes from: two spaces apart; '#': a comment.
_TABLE = r"""
mpi  vader_segment\..*  Open MPI vader/sm BTL: vader_segment.<host>.<...>
mpi  sm_segment\..*  Open MPI 5 sm BTL (vader renamed)
mpi  mpich_shar_tmp.*  MPICH shared-memory temp files
mpi  shm-col-space.*  Intel MPI / MPICH collectives
mpi  psm_shm\..*  Intel PSM (InfiniPath) shared memory
mpi  psm2_shm\..*  Intel PSM2 (Omni-Path) shared memory
nccl  nccl-.*  NCCL: nccl-XXXXXX (<= 2.11: nccl-shm-recv-*, -send-*)
ucx  ucx_shm_posix_.*  UCX posix transport (uct/sm/mm/posix)
torch  torch_.*  PyTorch file_system sharing: torch_<pid>_<rand>[_<n>]
python_shm  psm_.*  multiprocessing.shared_memory (vLLM/SGLang queues)
sglang  sgl_shm_.*  SGLang: sgl_shm_<kind>_<pid>_<rand> (multimodal sgl_shm_mm_*)
sglang  sglang_loads_.*  SGLang: sglang_loads_* (expert load statistics)
semaphore  sem\.loky-.*  joblib/loky semaphores: sem.loky-<pid>-<rand>
semaphore  sem\..*  glibc sem_open(): /dev/shm/sem.<name>
# Unlinked once every worker mapped it (vLLM PR 52596): then a hidden segment.
vllm_offload  vllm_offload_.*  vLLM CPU KV offload: vllm_offload_<uuid>.mmap
ray  plasma.*  Ray plasma object store
nixl  nixl_.*  NVIDIA NIXL (disaggregated KV transfer)
dali  nvidia_dali_.*  NVIDIA DALI shared memory
triton  triton_python_backend_shm_region_.*  Triton python backend
cuda  cuda\.shm\..*  CUDA IPC / MPS: cuda.shm.<pid>.<n>
"""
CLASSES = tuple(re.findall(r"^(\w+)  (\S+)  (.+)", _TABLE, re.M))

CLASS_NAMES: Tuple[str, ...] = (*dict.fromkeys(c for c, _, _ in CLASSES), "other")

# One alternation, one fullmatch per name: the first row that matches names its group.
_COMBINED: Pattern[str] = re.compile(
    "|".join(f"(?P<r{i}>{p})" for i, (_, p, _) in enumerate(CLASSES)), re.S
)
_GROUP_CLASS = {f"r{i}": c for i, (c, _, _) in enumerate(CLASSES)}


def _class_of(basename: str) -> str:
    match = _COMBINED.fullmatch(basename.removesuffix(" (deleted)"))
    return _GROUP_CLASS[match.lastgroup] if match else "other"


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
