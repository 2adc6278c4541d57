"""What `shmwatch check` found, worst first, as text or the documented JSON. Exit codes:
0 all good, 1 warnings, 2 a requirement failed (--require-shm, --backend), 64 a usage
error (EX_USAGE, not 2: an initContainer tells "this pod's shm is too small" from "the
command line is wrong"), 70 a bug in check (EX_SOFTWARE, never a verdict)."""

import json
import math
import threading
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    List,
    SupportsFloat,
    Tuple,
    TypeVar,
    Union,
)

from exporter import __version__
from exporter.check.names import printable

EXIT_OK, EXIT_WARN, EXIT_FAIL, EXIT_USAGE, EXIT_SOFTWARE = 0, 1, 2, 64, 70
SEVERITIES = ("fail", "warn", "info", "ok")  # worst first
MAX_NAMED = 5  # segments, processes or holders named in a finding
# JSON facts in order; unreported: OBJECTS null, lists [] (recommendations: --recommend)
FACTS: Tuple[str, ...] = ("shm", "gpus", "host_memory", "cgroup", "pod_cgroups", "sysv")
FACTS += ("recommendations", "recommendation_notes", "oom_kills", "sysv_namespaces")
OBJECTS = ("host_memory", "cgroup", "sysv")
T = TypeVar("T")


@dataclass
class Finding:
    severity: str  # fail | warn | info | ok
    area: str  # gpu | shm | memory | sysv | log
    subject: str
    message: str
    remedy: str = ""


@dataclass
class Report:
    findings: List[Finding] = field(default_factory=list)
    # The JSON document's facts by name (FACTS; docs/check.md): what was read, as JSON values.
    facts: Dict[str, Any] = field(default_factory=dict)

    def add(
        self, severity: str, area: str, subject: str, message: str, remedy: str = ""
    ) -> None:
        finding = Finding(
            severity=severity,
            area=area,
            subject=subject,
            message=message,
            remedy=remedy,
        )
        self.findings.append(finding)

    @property
    def exit_code(self) -> int:
        severities = {f.severity for f in self.findings}
        if "fail" in severities:
            return EXIT_FAIL
        return EXIT_WARN if "warn" in severities else EXIT_OK

    def sorted(self) -> List[Finding]:
        return sorted(
            self.findings,
            key=lambda f: (SEVERITIES.index(f.severity), f.area, f.subject),
        )


def left(deadline: float) -> float:
    """Seconds until `deadline` (time.monotonic()), at least 0; no deadline (math.inf) is the
    longest wait a socket or a lock takes (an infinite one overflows)."""
    return min(threading.TIMEOUT_MAX, max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True)
class _Returned(Generic[T]):
    value: T


class Bounded(Generic[T]):
    """fn() on a daemon thread; `result(deadline)`: its answer, its exception, or TimeoutError.
    For a read that can block (a log on a hung filesystem, a server trickling a byte at a time, a
    name that does not resolve): one still blocked at the deadline is left, to end with check."""

    def __init__(self, fn: Callable[[], T]) -> None:
        # fn's answer or what it raised, once it has returned
        self._answer: List[Union[_Returned[T], BaseException]] = []
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], T]) -> None:
        try:
            self._answer.append(_Returned(fn()))
        except BaseException as err:  # raised to whoever waits for the answer
            self._answer.append(err)

    def result(self, deadline: float) -> T:
        self._thread.join(left(deadline))
        if not self._answer:
            raise TimeoutError("no complete answer within --timeout")
        answer = self._answer[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer.value


def render_text(report: Report) -> str:
    findings = report.sorted()
    problems = sum(f.severity in ("fail", "warn") for f in findings)
    lines = [f"shmwatch check {__version__}: {problems} problem(s), worst first", ""]
    lines.append(f"{'STATUS':<7}{'AREA':<8}{'SUBJECT':<28}WHAT")
    for f in findings:
        row = f"{f.severity.upper():<7}{f.area:<8}{f.subject[:27]:<28}"
        lines.append(row + f.message)
        if f.remedy:
            lines.append(f"{'':<43}-> {f.remedy}")
    # names are shown already: a last guard
    return "\n".join(map(printable, lines)) + "\n"


def render_json(report: Report) -> str:
    code = report.exit_code
    doc: Dict[str, Any] = {
        "version": 1,
        "shmwatch_version": __version__,
        "status": ("ok", "warn", "fail")[code],
        "exit_code": code,
        "findings": [asdict(f) for f in report.sorted()],
    }
    for name in FACTS:
        doc[name] = report.facts.get(name, None if name in OBJECTS else [])
    return json.dumps(doc, indent=2, default=str) + "\n"


# All of `check`'s sizes are formatted here. Advice rounds up: a setting made from it
# (--shm-size, shm_size, sizeLimit, memory limit) holds the bytes asked, G or Gi alike.
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Unit:
    name: str
    size: int  # bytes


UNITS = (
    Unit(name="GiB", size=GiB),
    Unit(name="MiB", size=MiB),
    Unit(name="KiB", size=KiB),
)
# The largest size `check` reads or advises (1 PiB): above any shm mount or memory limit. A
# larger reading is a broken answer, not a size (1e308 would print a 300-digit --shm-size).
MAX_BYTES = 1 << 50


def plausible(value: object) -> int:
    """A size from a flag or another program as whole bytes; ValueError unless it is a number
    from 0 to MAX_BYTES (NaN, +Inf, 1e308, -1, "abc" and None are not)."""
    number = _number(value)
    if not 0 <= number <= MAX_BYTES:
        raise ValueError(f"{repr(value)[:24]} is not a plausible size (0 to 1 PiB)")
    return int(number)


def _number(value: object) -> float:
    """`value` as float() reads it (an int as it is); NaN when it is no number."""
    if isinstance(value, int):
        return value
    if not isinstance(value, (str, bytes, SupportsFloat)):
        return math.nan
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def human(n: float) -> str:
    """A reading, to the nearest tenth: '1.5 GiB', '12 B'."""
    for unit in UNITS:
        if abs(n) >= unit.size:
            return f"{n / unit.size:.1f} {unit.name}"
    return f"{int(n)} B"


def at_least(n: float) -> str:
    """Advice that must hold n bytes ("raise the limit to ..."): `human`, rounded up."""
    return _tenths(n, math.ceil)


def at_most(n: float) -> str:
    """Advice that must stay within n bytes ("lower it to at most ..."): rounded down."""
    return _tenths(n, math.floor)


def _tenths(n: float, rounding: Callable[[Fraction], int]) -> str:
    exact = Fraction(n)
    for unit in UNITS:
        if exact >= unit.size:
            tenths = rounding(exact * 10 / unit.size)
            return f"{tenths // 10}.{tenths % 10} {unit.name}"
    return f"{rounding(exact)} B"


def round_up(n: float) -> int:
    """The size to advise for n bytes: whole GiB from 1 GiB up, whole MiB below, at least 1 MiB."""
    whole = math.ceil(n)
    unit = GiB if whole >= GiB else MiB
    return max(MiB, -(-whole // unit) * unit)


def quantities(n: int) -> Tuple[str, str]:
    """n bytes as docker --shm-size / --memory and compose shm_size / mem_limit take them, and
    as a Kubernetes quantity (sizeLimit, limits.memory): whole GiB, else MiB rounded up."""
    number, unit = (n // GiB, "G") if n % GiB == 0 else (-(-n // MiB), "M")
    return f"{number}{unit.lower()}", f"{number}{unit}i"
