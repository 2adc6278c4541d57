"""Every size `shmwatch check` prints or advises, in one place.

A reading (`human`) rounds to the nearest tenth of its unit. Advice rounds up, always: a
setting made from it (--shm-size, shm_size, sizeLimit, a memory limit) holds at least the
bytes it answers, whether those were asked for in decimal (16G) or binary (16Gi) units.
"""

import math
from fractions import Fraction

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
UNITS = (("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
# The largest size `check` reads or advises (1 PiB): above any shm mount or memory limit. A
# larger reading is a broken answer, not a size (1e308 would print a 300-digit --shm-size).
MAX_BYTES = 1 << 50


def plausible(value) -> int:
    """A size from a flag or another program as whole bytes; ValueError unless it is a number
    from 0 to MAX_BYTES (NaN, +Inf, 1e308, -1, "abc" and None are not)."""
    try:
        number = value if isinstance(value, int) else float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not 0 <= number <= MAX_BYTES:
        raise ValueError(f"{repr(value)[:24]} is not a plausible size (0 to 1 PiB)")
    return int(number)


def human(n: float) -> str:
    """A reading: '1.5 GiB', '12 B'."""
    for unit, size in UNITS:
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _tenths(n: float, rounding) -> str:
    n = Fraction(n)
    for unit, size in UNITS:
        if n >= size:
            tenths = rounding(n * 10 / size)
            return f"{tenths // 10}.{tenths % 10} {unit}"
    return f"{rounding(n)} B"


def at_least(n: float) -> str:
    """Advice that must hold n bytes ("raise the limit to ..."): `human`, rounded up."""
    return _tenths(n, math.ceil)


def at_most(n: float) -> str:
    """Advice that must stay within n bytes ("lower it to at most ..."): rounded down."""
    return _tenths(n, math.floor)


def round_up(n: float) -> int:
    """The size to advise for n bytes: whole GiB from 1 GiB up, whole MiB below, at least 1 MiB."""
    n = math.ceil(n)
    unit = GiB if n >= GiB else MiB
    return max(MiB, -(-n // unit) * unit)


def docker(n: int) -> str:
    """docker --shm-size / --memory, compose shm_size / mem_limit: whole g, else m rounded up."""
    return f"{n // GiB}g" if n % GiB == 0 else f"{-(-n // MiB)}m"


def k8s(n: int) -> str:
    """A Kubernetes quantity (sizeLimit, limits.memory): whole Gi, else Mi rounded up."""
    return f"{n // GiB}Gi" if n % GiB == 0 else f"{-(-n // MiB)}Mi"
