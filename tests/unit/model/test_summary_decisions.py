"""Tests of exporter/model/summary_decisions.py."""

from exporter.model.summary import owner_comm, shm_budget, summarise
from exporter.model.types import ClassTotals
from tests.helpers import GiB, MiB, cgroup, inventory, seg, usage


def test_the_oldest_orphan_is_the_oldest_removable_one():
    """Two removable orphans of different ages: the older one's mtime, not the newer's. Older
    segments that are not removable orphans (a semaphore, a linked or unverified one) do not count."""
    inv = inventory("/dev/shm", [
        seg("nccl-new", "nccl", "orphan", mtime=5000.0),
        seg("torch_1_old", "torch", "orphan", mtime=1000.0),
        seg("sem.x", "semaphore", "orphan", mtime=10.0),
        seg("other-file", "other", "orphan", mtime=20.0),
        seg("nccl-live", "nccl", "linked", mtime=1.0, holders=(7,)),
        seg("psm_unknown", "python_shm", "unverified", mtime=2.0),
    ])
    assert summarise(inv, 3).oldest_orphan_mtime == 1000.0
    assert summarise(inventory("/m", [seg("sem.y", "semaphore", "orphan", mtime=3.0)]),
                     3).oldest_orphan_mtime is None


def test_summary_totals_leaks_and_top():
    inv = inventory("/dev/shm", [
        seg("nccl-a", "nccl", "linked", 4 * MiB, holders=(9, 3)),
        seg("nccl-b", "nccl", "linked", 2 * MiB, holders=(3,)),
        seg("nccl-c", "nccl", "orphan", 3 * MiB),
        seg("psm_d", "python_shm", "orphan", 5 * MiB),
        seg("sem.e", "semaphore", "orphan", 4096),
        seg("torch_f", "torch", "hidden", 6 * MiB, holders=(4,)),
        seg("torch_g", "torch", "hidden", 1 * MiB, holders=(4,)),
        seg("psm_h", "python_shm", "unverified", 1 * MiB),
        seg("sem.i", "semaphore", "unverified", 4096),
        seg("psm_j", "python_shm", "unverified", 2 * MiB),
    ], process_bytes={9: 4 * MiB, 5: 6 * MiB, 4: 7 * MiB, 3: 6 * MiB})
    s = summarise(inv, 2)
    assert s.totals[("nccl", "linked")] == ClassTotals(count=2, allocated_bytes=6 * MiB, apparent_bytes=6 * MiB + 2)
    assert s.totals[("nccl", "orphan")] == ClassTotals(count=1, allocated_bytes=3 * MiB, apparent_bytes=3 * MiB + 1)
    assert s.bytes_by_class == {"nccl": 9 * MiB, "python_shm": 8 * MiB, "semaphore": 8192, "torch": 7 * MiB}
    assert (s.hidden_bytes, s.hidden_count) == (7 * MiB, 2)
    assert [x.name for x in s.top] == ["psm_d", "nccl-c"]  # leaks first (not the semaphore)
    assert s.top_processes == [(4, 7 * MiB), (3, 6 * MiB)]  # a tie goes to the lower pid
    assert [x.name for x in s.leaked] == ["psm_d", "nccl-c"]  # largest first, no semaphore
    assert [x.name for x in s.unverified] == ["psm_j", "psm_h"]  # largest first, no semaphore
    assert s.named_pids == {4, 3}
    assert [x.name for x in summarise(inv, 3).top] == ["psm_d", "nccl-c", "torch_f"]
    tie = inventory("/m", [seg("b", "other", "linked"), seg("a", "other", "linked")])
    assert [x.name for x in summarise(tie, 1).top] == ["a"]


def test_owner_comm():
    assert owner_comm([], {}) == ""
    assert owner_comm([12], {12: "python"}) == "python"
    assert owner_comm([12, 13], {}) == "unknown"
    assert owner_comm([12, 13, 14, 15], {12: "vllm"}) == "vllm"


def test_shm_budget_exact():
    b = shm_budget(usage(2 * GiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB))
    # 330 MiB used outside shm: 70 MiB of room, and a full 2 GiB mount would need 2378/400 of it.
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes) == (2 * GiB, 70 * MiB, 70 * MiB)
    assert b.projection == (330 * MiB + 2 * GiB) / (400 * MiB)
    b = shm_budget(usage(2 * GiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB), size_limit=50 * MiB)
    assert (b.fillable_bytes, b.effective_bytes) == (50 * MiB, 50 * MiB)
    assert b.projection == 380 / 400
    b = shm_budget(usage(2 * GiB, 0), None, memory_limit=512 * MiB)
    assert (b.fillable_bytes, b.effective_bytes, b.projection, b.room_bytes) == (2 * GiB, 512 * MiB, None,
                                                                                  512 * MiB)
    b = shm_budget(usage(2 * GiB, 0), cgroup(10, None), memory_limit=512 * MiB)  # unlimited cgroup
    assert (b.effective_bytes, b.projection, b.room_bytes) == (2 * GiB, None, None)
    assert shm_budget(usage(64 * MiB, 0), cgroup(0, 8 * GiB)).effective_bytes == 64 * MiB
