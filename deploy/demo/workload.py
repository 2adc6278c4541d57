"""A CPU-only stand-in for an LLM server, for the compose stack: it creates and frees
shared-memory segments the way vLLM's workers do (multiprocessing.shared_memory, a
semaphore, an NCCL-named file that is unlinked but kept mapped), and now and then
'crashes' and leaks one, so every dashboard row has something to show."""
import mmap
import os
import random
import time
from multiprocessing import resource_tracker, shared_memory

MiB = 1 << 20


def nccl_like():
    name = "/dev/shm/nccl-" + "".join(random.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=6))
    fd = os.open(name, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, 8 * MiB)
    mapping = mmap.mmap(fd, 8 * MiB)
    os.close(fd)
    os.unlink(name)  # NCCL >= 2.19 unlinks after attach: hidden, still counted by df
    return mapping


def main():
    held = [nccl_like()]
    while True:
        batch = [shared_memory.SharedMemory(create=True, size=random.randint(1, 16) * MiB) for _ in range(4)]
        for segment in batch:
            segment.buf[:MiB] = b"\1" * MiB
        time.sleep(random.uniform(5, 20))
        if random.random() < 0.1:  # a worker "crashes": its segment is never unlinked
            leaked = batch.pop()
            resource_tracker.unregister(leaked._name, "shared_memory")
            leaked.close()
        for segment in batch:
            segment.close()
            segment.unlink()
        if len(held) < 3 and random.random() < 0.3:
            held.append(nccl_like())


if __name__ == "__main__":
    main()
