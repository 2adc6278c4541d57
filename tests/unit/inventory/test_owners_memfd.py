# mypy: allow-untyped-calls
"""memfd regions: shmem no mount shows (CUDA host allocations, UCX, Mooncake), held by a
mapping or an open fd, each counted once, and each holder's memory cgroup. A /proc tree
(tests/helpers.FakeProc), and for open fds the test process's own real memfds."""

import os
import shutil
from pathlib import Path
from typing import List, Tuple

import pytest

from exporter.inventory.owners import MAX_MEMFDS
from exporter.model.types import MemfdTotals
from tests.helpers import devno, maps_line, mountinfo_line
from tests.unit.inventory.test_owners import MNT_ID, World, make_world

MEMFD_DEV = os.makedev(0, 1)  # the kernel's internal shm mount: in no mountinfo


@pytest.fixture
def world(tmp_path: Path) -> World:
    return make_world(tmp_path)


def memfd_maps(regions: List[Tuple[int, str, int]]) -> str:
    """(inode, name, bytes) -> maps lines of memfd regions, one page apart."""
    lines, at = "", 0x100000
    for inode, name, size in regions:
        lines += maps_line(at, at + size, MEMFD_DEV, inode, f"/memfd:{name} (deleted)")
        at += size + 0x1000
    return lines


def test_memfd_regions_are_held_by_class_with_their_holders_cgroups(
    world: World,
) -> None:
    shared = memfd_maps([(9001, "cuda.shm.0", 0x4000)])
    world.add(
        100,
        maps=shared + memfd_maps([(9002, "ucx_shm_posix_1", 0x2000)]),
        cgroup="0::/kubepods/pod-a/c1\n",
    )
    world.add(101, maps=shared, cgroup="4:memory:/kubepods/pod-b/c2\n1:cpu:/x\n")
    world.add(102, maps=memfd_maps([(9003, "x", 0x1000)]))  # no cgroup file: no path
    os.unlink(world.proc.path(102, "cgroup"))
    scan, owners = world.scan()
    regions, cgroups = scan.memfd_regions(owners)
    got = sorted(
        (r.name, r.cls, r.state, r.allocated_bytes, r.holders) for r in regions
    )
    assert got == [
        ("cuda.shm.0", "cuda", "hidden", 0x4000, (100, 101)),
        ("ucx_shm_posix_1", "ucx", "hidden", 0x2000, (100,)),
        ("x", "other", "hidden", 0x1000, (102,)),
    ]
    assert cgroups == {100: "/kubepods/pod-a/c1", 101: "/kubepods/pod-b/c2"}


def test_a_memfd_on_a_mounted_device_is_a_file_there_not_a_memfd(world: World) -> None:
    """A tenant's file at /memfd:x on a mount some namespace lists is not shmem of ours."""
    world.add(
        100, maps=maps_line(0x1000, 0x2000, MEMFD_DEV, 9001, "/memfd:x (deleted)")
    )
    world.add(
        101, mountinfo=world.mountinfo() + mountinfo_line(40, devno(MEMFD_DEV), "/srv")
    )
    scan, owners = world.scan()
    assert scan.memfd_regions(owners)[0] == []


def test_a_process_with_many_memfds_keeps_the_largest_one_by_one_and_counts_the_rest(
    world: World,
) -> None:
    """Each region counts once: in the totals of the first process that holds it."""
    sizes = [
        (10000 + i, f"cuda.shm.{i}", 0x1000 * (i + 1)) for i in range(MAX_MEMFDS + 2)
    ]
    world.add(100, maps=memfd_maps(sizes), cgroup="0::/pod\n")
    world.add(
        101, maps=memfd_maps([(10000, "cuda.shm.0", 0x1000), (20000, "psm_1", 0x1000)])
    )
    scan, owners = world.scan()
    regions, _ = scan.memfd_regions(owners)
    assert len(regions) == MAX_MEMFDS + 1  # 100's largest 64, and 101's own
    assert min(r.allocated_bytes for r in regions if r.holders == (100,)) == 0x3000
    assert owners.memfd_rest == {
        100: {"cuda": MemfdTotals(count=2, allocated_bytes=0x1000 + 0x2000)}
    }
    assert [r.name for r in regions if 101 in r.holders] == ["psm_1"]


def test_exactly_as_many_memfds_as_kept_are_all_kept(world: World) -> None:
    world.add(
        100,
        maps=memfd_maps(
            [(10000 + i, f"cuda.shm.{i}", 0x1000) for i in range(MAX_MEMFDS)]
        ),
    )
    scan, owners = world.scan()
    assert len(scan.memfd_regions(owners)[0]) == MAX_MEMFDS and owners.memfd_rest == {}


def test_a_region_kept_by_an_earlier_holder_is_not_counted_again_in_a_laters_rest(
    world: World,
) -> None:
    world.add(
        100, maps=memfd_maps([(10000, "cuda.shm.0", 0x1000)])
    )  # few: kept one by one
    many = [
        (10000 + i, f"cuda.shm.{i}", 0x1000 * (i + 1)) for i in range(MAX_MEMFDS + 3)
    ]
    world.add(101, maps=memfd_maps(many))  # its three smallest folded, 10000 among them
    scan, owners = world.scan()
    assert owners.memfd_rest == {
        101: {"cuda": MemfdTotals(count=2, allocated_bytes=0x2000 + 0x3000)}
    }
    regions, _ = scan.memfd_regions(owners)
    [shared] = [r for r in regions if r.key == (MEMFD_DEV, 10000)]
    assert shared.holders == (100,)


def test_memfds_are_not_told_from_files_where_the_mountinfo_is_unread(
    world: World,
) -> None:
    world.add(100, maps=memfd_maps([(9001, "cuda.shm.0", 0x4000)]))
    world.proc.deny(100, "mountinfo")
    scan, owners = world.scan()
    assert scan.memfd_regions(owners)[0] == [] and 100 not in owners.holders


def own_fds(world: World, pid: int) -> None:
    """The fixture process's fds and fdinfo are this test process's own."""
    world.add(pid, mountinfo=mountinfo_line(MNT_ID, devno(world.dev), str(world.shm)))
    for name in ("fd", "fdinfo"):
        shutil.rmtree(world.proc.path(pid, name))
        os.symlink(f"/proc/{os.getpid()}/{name}", world.proc.path(pid, name))


def test_many_memfds_held_open_keep_the_most_allocated_one_by_one(world: World) -> None:
    """Sparse regions: the allocated pages, not the size asked, decide which are kept and
    what the rest count (the smallest allocation asked the most)."""
    fds = []
    try:
        for i in range(MAX_MEMFDS + 2):
            fds.append(fd := os.memfd_create(f"cuda.shm.{i}"))
            os.ftruncate(fd, (100 - i) << 20)
            os.pwrite(fd, b"x" * (4096 * (i + 1)), 0)
        own_fds(world, 100)
        scan, owners = world.scan()
        regions, _ = scan.memfd_regions(owners)
        assert len(regions) == MAX_MEMFDS
        assert min(r.allocated_bytes for r in regions) == 3 * 4096
        assert owners.memfd_rest == {
            100: {"cuda": MemfdTotals(count=2, allocated_bytes=4096 + 2 * 4096)}
        }
    finally:
        for fd in fds:
            os.close(fd)


def test_a_memfd_held_open_is_a_region_with_its_stat(world: World) -> None:
    """A real memfd of this process, seen through its own fd and fdinfo: the fd's stat, not a
    mapping's extent, says its size (the allocated pages of a sparse one)."""
    fd = os.memfd_create("vllm_offload_kv")
    try:
        os.ftruncate(fd, 1 << 20)
        os.pwrite(fd, b"x" * 8192, 0)
        world.add(
            100, mountinfo=mountinfo_line(MNT_ID, devno(world.dev), str(world.shm))
        )
        for name in ("fd", "fdinfo"):
            shutil.rmtree(world.proc.path(100, name))
            os.symlink(f"/proc/{os.getpid()}/{name}", world.proc.path(100, name))
        scan, owners = world.scan()
        regions, _ = scan.memfd_regions(owners)
        st = os.fstat(fd)
        got = [
            (
                r.name,
                r.cls,
                r.state,
                r.allocated_bytes,
                r.apparent_bytes,
                r.holders,
                r.key,
            )
            for r in regions
        ]
        assert got == [
            (
                "vllm_offload_kv",
                "vllm_offload",
                "hidden",
                8192,
                1 << 20,
                (100,),
                (st.st_dev, st.st_ino),
            )
        ]
        assert owners.holders.keys() == {100}
    finally:
        os.close(fd)
