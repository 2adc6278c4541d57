"""The "server" of the container tier: holds shared memory the ways LLM servers do, leaves
one real leak, prints what it made as one JSON line, then waits to be stopped.

- nccl-*: fallocate'd and mmap'd, left linked (NCCL before 2.19 keeps the name);
- torch_<pid>_*: created, unlinked, held by its fd only (torch's file_descriptor strategy);
- psm_*: multiprocessing.shared_memory, mapped (vLLM's MessageQueue);
- a SysV segment, attached (UCX's sysv transport), through libc shmget/shmat;
- nccl-leak*: written by a child process that exited without unlinking (a crashed worker),
  its mtime set an hour back so its age is unmistakable;
- libpod_lock: a file of class `other` that nobody maps (podman's lock file has this name):
  not ours to judge, so never to be advised for removal.
"""
import ctypes
import json
import mmap
import os
import signal
import sys
import time
from multiprocessing import resource_tracker, shared_memory

MiB = 1 << 20
IPC_PRIVATE, IPC_CREAT = 0, 0o1000
SIZES = {"nccl": 12 * MiB, "torch": 4 * MiB, "psm": 4 * MiB, "leak": 16 * MiB, "sysv": 2 * MiB}


def fallocated(path, size):
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    return fd


def sysv_segment(size):
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shmid = libc.shmget(IPC_PRIVATE, ctypes.c_size_t(size), IPC_CREAT | 0o600)
    if shmid < 0:
        raise OSError(ctypes.get_errno(), "shmget")
    address = libc.shmat(shmid, None, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "shmat")
    ctypes.memset(address, 1, size)
    # Not removed: it lives in the container's IPC namespace, which goes with the container.
    return shmid


def aged(path):
    """Last written an hour ago, as the segments of a server that has run a while: shmwatch
    names (shmwatch_top_segment_bytes) only segments a minute old, leaks 15 s old."""
    hour_ago = time.time() - 3600
    os.utime(path, (hour_ago, hour_ago))


def leak_from_child(path, size):
    pid = os.fork()
    if pid == 0:  # the "worker": writes its segment and dies without cleaning up
        os.close(fallocated(path, size))
        hour_ago = time.time() - 3600
        os.utime(path, (hour_ago, hour_ago))
        os._exit(0)
    os.waitpid(pid, 0)


def main():
    tag = sys.argv[1] if len(sys.argv) > 1 else "s"
    nccl = f"/dev/shm/nccl-{tag}live"
    fd = fallocated(nccl, SIZES["nccl"])
    nccl_map = mmap.mmap(fd, SIZES["nccl"])
    os.close(fd)
    aged(nccl)

    torch = f"/dev/shm/torch_{os.getpid()}_{tag}"
    torch_fd = fallocated(torch, SIZES["torch"])
    aged(torch)  # its inode keeps the time once unlinked: read through the fd
    os.unlink(torch)

    psm = shared_memory.SharedMemory(create=True, size=SIZES["psm"])
    psm.buf[:] = b"\1" * SIZES["psm"]
    aged("/dev/shm/" + psm.name.lstrip("/"))
    # The exit is a `docker rm -f`: the tracker must not unlink it under a sidecar's eyes.
    # The tracker registered the POSIX name, with the slash `.name` leaves off.
    resource_tracker.unregister("/" + psm.name, "shared_memory")

    shmid = sysv_segment(SIZES["sysv"])
    leak = f"/dev/shm/nccl-leak{tag}"
    leak_from_child(leak, SIZES["leak"])
    os.close(fallocated("/dev/shm/libpod_lock", 64 << 10))
    aged("/dev/shm/libpod_lock")

    print(json.dumps({"pid": os.getpid(), "uid": os.getuid(), "nccl": os.path.basename(nccl),
                      "torch": os.path.basename(torch), "psm": psm.name.lstrip("/"), "leak": os.path.basename(leak), "other": "libpod_lock",
                      "shmid": shmid, "sizes": SIZES}), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    held = (nccl_map, torch_fd, psm)  # noqa: F841 (what the server holds until it is stopped)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
