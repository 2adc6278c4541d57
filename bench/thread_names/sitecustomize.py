"""Loaded by the benchmarks only (their exporters' PYTHONPATH): each Python thread writes its
name into /proc/<pid>/task/<tid>/comm as it starts, so a benchmark can read CPU per thread by
name (bench/node_scale.py --tree). The kernel keeps 15 bytes of a name.

threading.setprofile's function runs first in every thread started after it is set, inside
that thread: it names the thread and takes itself away, so nothing else is profiled."""

import ctypes
import sys
import threading

PR_SET_NAME = 15
_libc = ctypes.CDLL(None, use_errno=True)


def name_this_thread(*_: object) -> None:
    sys.setprofile(None)
    name = threading.current_thread().name.removeprefix("shmwatch-")  # 15 bytes are few
    _libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)


threading.setprofile(name_this_thread)
name_this_thread()
