"""The engines' kinds of shared memory, made for real, as SGLang, vLLM and Mooncake/UCX make them.

Run it like shm_peer.py (tests/conftest.py's Peer: /dev/shm is the test's tmpfs). It prints
'ready <info>' once the memory is in place, then holds it until stdin closes (or exits at once
for a leak).

modes:
  sglang SIZE        sgl_shm_mm_<pid>_<rand> (SGLang's multimodal buffer: shm_open'ed through
                     SharedMemory, written, held); info: its name
  sglang-leak SIZE   as sglang, then the process exits without unlinking it (a scheduler crash)
  vllm-offload SIZE  vllm_offload_<uuid>.mmap created, mapped, then unlinked once mapped (vLLM
                     PR 52596): a hidden segment; info: its name
  memfd SIZE [CGROUP_DIR]
                     joins CGROUP_DIR (a v1 memory cgroup) if given, memfd_create("mooncake_
                     transfer"), writes SIZE bytes (charged to the cgroup as shmem), maps it, and
                     passes the fd to a child over a Unix socket (SCM_RIGHTS); the child maps it
                     and closes the fd: the parent holds fd and mapping, the child (named
                     CHILD_COMM) the mapping.
                     info: the child's pid
"""
import ctypes
import mmap
import os
import secrets
import socket
import subprocess
import sys
import uuid

from shm_peer import map_shared

MEMFD_NAME = "mooncake_transfer"
CHILD_COMM = "memfd-child"


def wait_for_stdin_close():
    sys.stdout.flush()
    sys.stdin.read()


def sglang(size, leak):
    from multiprocessing import resource_tracker, shared_memory

    name = f"sgl_shm_mm_{os.getpid()}_{secrets.token_hex(4)}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=size)
    shm.buf[:size] = b"\1" * size  # every page touched: allocated == size
    if leak:
        # The tracker registered the POSIX name, with the slash `.name` leaves off.
        resource_tracker.unregister("/" + shm.name, "shared_memory")  # nobody will unlink it
        shm.close()
        print("ready", name, flush=True)
        return
    print("ready", name, flush=True)
    wait_for_stdin_close()
    shm.close()
    shm.unlink()


def vllm_offload(size):
    name = f"vllm_offload_{uuid.uuid4()}.mmap"
    path = os.path.join("/dev/shm", name)
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
    os.posix_fallocate(fd, 0, size)
    region = mmap.mmap(fd, size)  # mmap keeps its own dup of the fd
    os.close(fd)
    os.unlink(path)  # every worker has mapped it
    print("ready", name, flush=True)
    wait_for_stdin_close()
    region.close()


def memfd_child(sock_fd):
    # A name of its own (prctl PR_SET_NAME), as an engine's worker has: shmwatch's series
    # name processes by their comm.
    ctypes.CDLL(None).prctl(15, CHILD_COMM.encode(), 0, 0, 0)
    sock = socket.socket(fileno=sock_fd)
    _, fds, _, _ = socket.recv_fds(sock, 16, 1)
    size = os.fstat(fds[0]).st_size
    map_shared(fds[0], size)  # mmap(2) itself: no dup of the fd kept
    os.close(fds[0])  # the mapping alone holds it now
    sock.sendall(b"mapped")
    sock.recv(1)  # until the parent goes


def memfd(size, cgroup_dir):
    if cgroup_dir:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    fd = os.memfd_create(MEMFD_NAME)
    os.ftruncate(fd, size)
    region = mmap.mmap(fd, size)
    region[:] = b"\1" * size  # written here: its pages are charged to this cgroup
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, __file__, "memfd-child", str(theirs.fileno())],
                             pass_fds=[theirs.fileno()])
    theirs.close()
    socket.send_fds(ours, [b"fd"], [fd])
    assert ours.recv(16) == b"mapped"
    print("ready", child.pid, flush=True)
    wait_for_stdin_close()
    ours.close()
    child.wait(10)
    region.close()
    os.close(fd)


def main(argv):
    mode = argv[0]
    if mode == "memfd-child":
        return memfd_child(int(argv[1]))
    size = int(argv[1])
    if mode in ("sglang", "sglang-leak"):
        return sglang(size, mode == "sglang-leak")
    if mode == "vllm-offload":
        return vllm_offload(size)
    if mode == "memfd":
        return memfd(size, argv[2] if len(argv) > 2 else "")
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
