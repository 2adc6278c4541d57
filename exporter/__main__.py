"""`python3 -m exporter` and the `shmwatch` command. The process runs with glibc's malloc for
Python's objects too (PYTHONMALLOC=malloc), not pymalloc: a leak storm's rows fill pymalloc
arenas of 1 MiB, and each stays while any one object in it lives (a later run's, a render's),
so RSS never comes back; glibc frees by the page and gives them back when asked
(runtime/memory.py). PYTHONMALLOC is read only as Python starts: the command starts Python
again with it set, before importing anything else."""

import os
import sys

ALLOCATOR = "malloc"


def with_glibc_malloc() -> None:
    """Starts this command again under PYTHONMALLOC=malloc (the same process: exec) unless
    PYTHONMALLOC is set already; to keep pymalloc, set PYTHONMALLOC=pymalloc."""
    if "PYTHONMALLOC" in os.environ or not (sys.executable and sys.orig_argv):
        return
    os.execve(sys.executable, sys.orig_argv, {**os.environ, "PYTHONMALLOC": ALLOCATOR})


def run() -> int:
    with_glibc_malloc()
    from exporter.cli import main

    return main()


if __name__ == "__main__":
    raise SystemExit(run())
