"""libc calls the standard library lacks: malloc_trim, statx's unique mount ID, setns."""

import ctypes
import ctypes.util
import errno
import os
import struct
from typing import Optional

# Looked up once: ctypes makes a new type (a garbage cycle) per first lookup and array type,
# and a node joins 200 IPC namespaces every inventory run.
try:
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    _TRIM, _STATX = getattr(_LIBC, "malloc_trim", None), getattr(_LIBC, "statx", None)
    _SETNS = getattr(_LIBC, "setns", None)
except OSError:
    _TRIM = _STATX = _SETNS = None
_BUFFER = ctypes.c_char * 256  # struct statx
STATX_MNT_ID_UNIQUE = 0x4000  # Linux 6.8
AT_FDCWD, AT_NOFOLLOW, AT_DONT_SYNC = -100, 0x100, 0x4000


def release_memory() -> None:
    """Returns freed heap pages glibc keeps until asked (a leak storm's inventory gone)."""
    if _TRIM is not None:
        _TRIM(0)


def setns(fd: int, nstype: int) -> None:
    """Moves the calling thread into the namespace `fd` names (os.setns from Python 3.12)."""
    if _SETNS is None or _SETNS(fd, nstype) != 0:
        err = errno.ENOSYS if _SETNS is None else ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def unique_mount_id(path: str) -> Optional[int]:
    """The ID of the mount at `path` no later mount reuses until reboot (mountinfo's IDs and a
    tmpfs's device number go to the next mount at once); None before Linux 6.8."""
    if _STATX is None:
        return None
    buf, flags = _BUFFER(), AT_NOFOLLOW | AT_DONT_SYNC
    failed = _STATX(AT_FDCWD, os.fsencode(path), flags, STATX_MNT_ID_UNIQUE, buf)
    if failed or not struct.unpack_from("<I", buf, 0)[0] & STATX_MNT_ID_UNIQUE:
        return None
    mount_id: int = struct.unpack_from("<Q", buf, 144)[0]  # stx_mnt_id
    return mount_id
