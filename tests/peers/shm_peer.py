"""A real process that creates, maps, unlinks or leaks shared memory, as LLM servers do.

Run it in a mount namespace where the test's tmpfs is bind-mounted at /dev/shm, so
shm_open() and SharedMemory land there. It prints one line 'ready <info>' when the
segment is in place, then holds it until stdin closes. SHM_PEER_COMM names the process
(its comm), as any process may name itself (prctl PR_SET_NAME); SHM_PEER_UNDUMPABLE makes
it not dumpable (PR_SET_DUMPABLE 0), as any process may: /proc/<pid> is then root's.

modes:
  psm SIZE           multiprocessing.shared_memory.SharedMemory, held (vLLM MessageQueue)
  mapped NAME SIZE   fallocate'd /dev/shm/NAME, mmap'ed, fd closed (NCCL < 2.19)
  hidden NAME SIZE   as mapped, then unlinked: still mapped (NCCL >= 2.19 after attach)
  fdonly NAME SIZE   created, written, unlinked, fd kept open, not mapped (torch file_descriptor)
  leak SIZE          SharedMemory created, untracked, process exits: an orphan
  left NAME SIZE     fallocate'd /dev/shm/NAME, written, closed, process exits: an orphan
                     of any class (what a crashed NCCL/UCX/MPI rank leaves)
  sparse NAME SIZE   ftruncate'd only (apparent SIZE, nothing allocated), mapped
  partial NAME SIZE ALLOC MAP
                     ftruncate'd to SIZE, ALLOC bytes at its start allocated, its first MAP
                     bytes mapped, then unlinked: a hidden segment whose mapping extent
                     (MAP) is neither its real allocation (ALLOC) nor its size (SIZE)
"""
import ctypes
import mmap
import os
import sys

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
LIBC.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)


def map_shared(fd, length):
    """mmap(2) itself: Python's mmap.mmap dup()s the fd and keeps it open, so a peer built
    on it would hold an fd as well as the mapping, and never test the mapping-only path
    (NCCL and UCX close the fd once mapped)."""
    address = LIBC.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed")
    return address


def wait_for_stdin_close():
    sys.stdout.flush()
    sys.stdin.read()


def make(name, size, allocate=True):
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    if allocate:
        os.posix_fallocate(fd, 0, size)
    else:
        os.ftruncate(fd, size)
    return path, fd


def main(argv):
    if comm := os.environ.get("SHM_PEER_COMM"):
        with open("/proc/self/comm", "w") as f:
            f.write(comm)
    if os.environ.get("SHM_PEER_UNDUMPABLE"):  # its /proc/<pid> then shows as root's
        PR_SET_DUMPABLE = 4
        LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    mode = argv[0]
    if mode in ("psm", "leak"):
        from multiprocessing import resource_tracker, shared_memory
        size = int(argv[1])
        shm = shared_memory.SharedMemory(create=True, size=size)
        shm.buf[:size] = b"\1" * size  # touch every page: allocated == size
        if mode == "leak":
            # What a crashed engine leaves: nobody will unlink it.
            # The tracker registered the POSIX name, with the slash `.name` leaves off.
            resource_tracker.unregister("/" + shm.name, "shared_memory")
            shm.close()
            print("ready", shm.name, flush=True)
            return
        print("ready", shm.name, flush=True)
        wait_for_stdin_close()
        shm.close()
        shm.unlink()
        return
    name, size = argv[1], int(argv[2])
    if mode == "partial":
        alloc, map_len = int(argv[3]), int(argv[4])
        path, fd = make(name, size, allocate=False)
        os.posix_fallocate(fd, 0, alloc)
        address = map_shared(fd, map_len)
        os.close(fd)
        os.unlink(path)
        print("ready", name, flush=True)
        wait_for_stdin_close()
        LIBC.munmap(address, map_len)
        return
    path, fd = make(name, size, allocate=(mode != "sparse"))
    if mode == "left":
        os.pwrite(fd, b"\1", 0)
        os.close(fd)
        print("ready", name, flush=True)
        return
    if mode == "fdonly":
        os.unlink(path)
        print("ready", name, flush=True)
        wait_for_stdin_close()
        os.close(fd)
        return
    address = map_shared(fd, size)
    os.close(fd)
    if mode == "hidden":
        os.unlink(path)
    print("ready", name, flush=True)
    wait_for_stdin_close()
    LIBC.munmap(address, size)
    if mode in ("mapped", "sparse"):
        os.unlink(path)


if __name__ == "__main__":
    main(sys.argv[1:])
