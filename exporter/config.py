"""Command-line flags, node_exporter style, each also read from SHMWATCH_<FLAG> (a given flag
wins; a repeatable one's variable is a comma list); a bad value: one line naming it, exit 2.

Every flag is one field of `Config`, declared by one `flag(...)` call in the field's place:
its name, the function that parses its text, its default (text, parsed as a given value
is), its help. --help, the SHMWATCH_ variable, the README's table (docs/generate.py) and the
value in Config all come from that call. Adding a flag is adding a field:

    top_k: int = flag("--segments.top-k", parse_count, default="10", help="How many ...")

A field with no default is Optional (None when the flag is not given), a repeatable flag's
is a tuple (`repeatable_flag`), and `not_with` names a field this one may not be given with.
The --[no-]collector.<name> switches come from the collectors' registry (each collector
registers itself in its module), and --no-inotify is a switch of its own.
"""

import argparse
import math
import os
import re
from dataclasses import dataclass, field, fields
from fractions import Fraction
from types import MappingProxyType
from typing import (
    Any,
    Callable,
    Dict,
    Generic,
    Mapping,
    NoReturn,
    Optional,
    Protocol,
    Sequence,
    Tuple,
    TypeVar,
    cast,
    overload,
)

from exporter.collectors import REGISTRY
from exporter.model.catalogue import MetricSelection

PROG = "shmwatch"
DESCRIPTION = "Prometheus exporter for shared memory in LLM-serving pods."
T = TypeVar("T")

# --- what a flag's text may be: text -> value, or a ValueError that says what is wrong --------

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]i?)?b?\s*$", re.IGNORECASE)
LOG_LEVELS = ("debug", "info", "warning", "error")


def parse_duration(text: str, zero: bool = False) -> float:
    """'500ms', '15s', '1m', '2h' or bare seconds -> seconds > 0; `zero`: 0 too ("never wait")."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"invalid duration {text!r} (use e.g. 500ms, 15s, 1m)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # 400 digits make inf, and sleep(inf) raises
        raise ValueError(f"invalid duration {text!r}: too large")
    if seconds <= 0 and not (zero and set(match.group(1)) <= set("0.")):
        raise ValueError(f"invalid duration {text!r}: must be above 0")
    return seconds


def parse_duration_or_zero(text: str) -> float:
    """As parse_duration, and 0 ("0", "0s", "0.0") for "no wait"."""
    return parse_duration(text, zero=True)


def parse_size(text: str) -> int:
    """'64Mi', '16Gi', '2g', '512k', '1048576' -> bytes; Kubernetes' K, M, G are decimal,
    docker's lower-case k, m, g (`--shm-size 2g`) binary."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"invalid size {text!r} (use e.g. 64Mi, 16Gi, 2g)")
    # Exact: a float would round sizes above 2**53 and make inf of a long digit string.
    number, suffix = Fraction(match.group(1)), match.group(2) or ""
    power = "kmgtpe".index(suffix[0].lower()) + 1 if suffix else 0
    binary = suffix.lower().endswith("i") or suffix[:1].islower()
    return int(number * (1024 if binary else 1000) ** power)


@dataclass(frozen=True)
class ListenAddress:
    # '' is every address, IPv6 and IPv4; an IPv6 address is without its brackets.
    host: str
    port: int


def parse_listen_address(text: str) -> ListenAddress:
    """':9841', '[::]:9841', '127.0.0.1:0', '[::1]:9841' -> host and port."""
    host, sep, port = str(text).rpartition(":")
    why = "use host:port, e.g. :9841"
    if sep and port.isdigit() and int(port) <= 65535:
        bracketed = host.startswith("[")
        if bracketed == host.endswith("]") and (bracketed or ":" not in host):
            return ListenAddress(host=host[1:-1] if bracketed else host, port=int(port))
        why = "an IPv6 host goes in brackets: [::1]:9841"
    raise ValueError(f"invalid address {text!r} ({why})")


def parse_text(text: str) -> str:
    return text


def parse_url_path(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError(f"must start with '/', got {text!r}")
    return text


def parse_count(text: str) -> int:
    """A whole number above 0."""
    if not (text.isdigit() and int(text) > 0):
        raise ValueError(f"invalid count {text!r}: a whole number above 0")
    return int(text)


def parse_regex(text: str) -> str:
    """A regular expression that compiles; kept as text. An empty one is refused: it would
    match every name (searched) or none (anchored), never what was meant."""
    if not text:
        raise ValueError("an empty regex: give one, or leave the flag out")
    try:
        return re.compile(text).pattern
    except re.error as err:
        raise ValueError(f"invalid regex: {err}") from None


def parse_mount_point(text: str) -> str:
    """A mount point as mountinfo names it: an absolute path, no trailing slash but '/'
    itself. An empty text (`--shm.mount=`) is refused: read as '/', it would walk the whole
    root filesystem as if it were a tmpfs (an empty variable is a list of none: not given)."""
    if not text.startswith("/"):
        raise ValueError(f"must be an absolute path, e.g. /dev/shm, got {text!r}")
    return text.rstrip("/") or "/"


def parse_log_level(text: str) -> str:
    """One of LOG_LEVELS in any case, kept as given."""
    if text.lower() not in LOG_LEVELS:
        raise ValueError(f"unknown level {text!r}")
    return text


@dataclass(frozen=True)
class OneOf:
    """A parser that takes exactly one of `choices`."""

    choices: Tuple[str, ...]

    def __call__(self, text: str) -> str:
        if text not in self.choices:
            raise ValueError(f"{text!r} is not one of {', '.join(self.choices)}")
        return text


def one_of(*choices: str) -> OneOf:
    return OneOf(choices=choices)


def typed(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: its ValueError's text becomes argparse's message."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def env_name(flag: str) -> str:
    """'--web.listen-address' -> 'SHMWATCH_WEB_LISTEN_ADDRESS'."""
    return "SHMWATCH_" + re.sub(r"[.\-]", "_", flag.lstrip("-")).upper()


def comma_items(text: str) -> Tuple[str, ...]:
    """'a, b,,' -> ('a', 'b'): a comma list's items, stripped, the empty ones dropped."""
    return tuple(item for item in (part.strip() for part in text.split(",")) if item)


# --- how a field of Config is given ----------------------------------------------------------


@dataclass(frozen=True)
class TableRow:
    """One row of the README's flags table."""

    flag: str
    env: str
    # As shown: '`15s`', 'on', '—'.
    default: str
    what: str


class FlagError(ValueError):
    """A flag's value, or two flags together, that cannot be: the message names the flag."""


class Declaration(Protocol):
    """How one field of Config is given: what it adds to the parser, its value (read back
    from what was parsed and the environment; `earlier`: the values of the fields declared
    above it), and its rows in the README."""

    def add_to(self, parser: argparse.ArgumentParser, dest: str) -> None: ...

    def value(
        self, parsed: argparse.Namespace, dest: str, earlier: Mapping[str, Any]
    ) -> Any: ...

    def table_rows(self) -> Tuple[TableRow, ...]: ...


# The key of a Config field's metadata that holds its Declaration.
DECLARATION = "shmwatch.flag"


@dataclass(frozen=True)
class Flag(Generic[T]):
    """`--name VALUE`, or SHMWATCH_NAME, or its default; each text parsed by `parse`."""

    name: str
    parse: Callable[[str], T]
    help: str
    # Text, parsed as a given value is; None: the field is None (or () if repeatable).
    default: Optional[str] = None
    # Given again, it adds a value; its variable is a comma list (items stripped, empty ones
    # dropped: a variable with no item is one not given, as an empty one is for any flag).
    repeatable: bool = False
    # In --help; '' for the field's name in capitals.
    metavar: str = ""
    # A field declared above this one that may not be given with it.
    not_with: str = ""

    def __post_init__(self) -> None:
        if self.not_with and self.default is not None:
            raise ValueError(f"{self.name}: a flag with a default is always given")

    @property
    def env(self) -> str:
        return env_name(self.name)

    def add_to(self, parser: argparse.ArgumentParser, dest: str) -> None:
        parser.add_argument(  # not given: None, and value() reads its variable or default
            self.name,
            dest=dest,
            type=typed(self.parse),
            action="append" if self.repeatable else "store",
            metavar=self.metavar or dest.upper(),
            help=f"{self.help} [env {self.env}]",
        )

    def value(
        self, parsed: argparse.Namespace, dest: str, earlier: Mapping[str, Any]
    ) -> Any:
        given = getattr(parsed, dest)
        if given is None:
            text = self._variable()
            given = self._from_text(self.default if text is None else text)
        if self.repeatable:
            return tuple(dict.fromkeys(given or ()))  # in order, each once
        return given

    def _variable(self) -> Optional[str]:
        """The variable's text; None if it is not set, empty, or a repeatable flag's with no
        item: an empty variable is one not given, as in kingpin (Prometheus' exporters), so
        `SHMWATCH_METRIC_DENYLIST=` is no list and `SHMWATCH_SEGMENTS_IGNORE_UNREADABLE=` no
        regex, as if unset."""
        text = os.environ.get(self.env)
        if text is None or not (comma_items(text) if self.repeatable else text):
            return None
        return text

    def _from_text(self, text: Optional[str]) -> Any:
        """The variable's text (or the default's) parsed; a repeatable flag's is a comma list."""
        if text is None:
            return None
        try:
            if self.repeatable:
                return [self.parse(item) for item in comma_items(text)]
            return self.parse(text)
        except ValueError as err:
            raise FlagError(f"argument {self.name} (from {self.env}): {err}") from None

    def table_rows(self) -> Tuple[TableRow, ...]:
        repeatable = " (repeatable)" if self.repeatable else ""
        return (
            TableRow(
                flag=f"`{self.name}`{repeatable}",
                env=f"`{self.env}`",
                default=f"`{self.default}`" if self.default else "—",
                what=self.help,
            ),
        )


def _field(declared: Declaration) -> Any:
    """A field of Config, with no default (parse_args gives every one), that holds how it is
    given in its metadata."""
    return field(metadata={DECLARATION: declared})


@overload
def flag(
    name: str,
    parse: Callable[[str], T],
    *,
    help: str,
    default: str,
    metavar: str = "",
) -> T: ...


@overload
def flag(
    name: str,
    parse: Callable[[str], T],
    *,
    help: str,
    default: None = None,
    metavar: str = "",
    not_with: str = "",
) -> Optional[T]: ...


def flag(
    name: str,
    parse: Callable[[str], T],
    *,
    help: str,
    default: Optional[str] = None,
    metavar: str = "",
    not_with: str = "",
) -> Any:
    """A field of Config given by `name VALUE`: its value is `parse`'s, or None (no default
    and not given)."""
    return _field(
        Flag(
            name=name,
            parse=parse,
            help=help,
            default=default,
            metavar=metavar,
            not_with=not_with,
        )
    )


def repeatable_flag(
    name: str,
    parse: Callable[[str], T],
    *,
    help: str,
    default: Optional[str] = None,
    metavar: str = "",
    not_with: str = "",
) -> Tuple[T, ...]:
    """A field of Config given by `name VALUE` as often as wanted: a tuple of `parse`'s
    values, each once, in order (the default, a comma list, when none is given)."""
    declared = Flag(
        name=name,
        parse=parse,
        help=help,
        default=default,
        repeatable=True,
        metavar=metavar,
        not_with=not_with,
    )
    return cast(Tuple[T, ...], _field(declared))


def _switch_from_env(env: str, default: Optional[bool]) -> Optional[bool]:
    """A switch's variable: 0, false, no or off (any case) is off, anything else on."""
    text = os.environ.get(env)
    if text is None:
        return default
    return text.strip().lower() not in ("0", "false", "no", "off")


@dataclass(frozen=True)
class CollectorSwitches:
    """--[no-]collector.<name> for each registered collector that has a switch; one that
    registered for node mode only is on by default in node mode (the `mode` field above)."""

    def names(self) -> Tuple[str, ...]:
        return tuple(r.name for r in REGISTRY.values() if r.flag)

    def node_only(self, name: str) -> bool:
        return "sidecar" not in REGISTRY[name].modes

    def add_to(self, parser: argparse.ArgumentParser, dest: str) -> None:
        for name in self.names():
            flag = f"--collector.{name}"
            default = "on in node mode" if self.node_only(name) else "on"
            parser.add_argument(  # and --no-collector.<name>
                flag,
                dest=f"{dest}_{name}",
                action=argparse.BooleanOptionalAction,
                default=_switch_from_env(
                    env_name(flag), None if self.node_only(name) else True
                ),
                help=f"Enable or disable the {name} collector (default {default}) "
                f"[env {env_name(flag)}].",
            )

    def value(
        self, parsed: argparse.Namespace, dest: str, earlier: Mapping[str, Any]
    ) -> Any:
        node = earlier["mode"] == "node"
        on = {name: getattr(parsed, f"{dest}_{name}") for name in self.names()}
        return MappingProxyType({n: node if v is None else v for n, v in on.items()})

    def table_rows(self) -> Tuple[TableRow, ...]:
        return tuple(
            TableRow(
                flag=f"`--collector.{name}` / `--no-collector.{name}`",
                env=f"`{env_name('--collector.' + name)}`",
                default="on in node mode" if self.node_only(name) else "on",
                what=f"Enable or disable the {name} collector.",
            )
            for name in self.names()
        )


@dataclass(frozen=True)
class OffSwitch:
    """`name` (a --no-<what> flag) turns off what is on; so does its variable set to false."""

    name: str
    env: str
    help: str
    # The README's words for it, and its default column.
    readme: str
    shown_default: str

    def add_to(self, parser: argparse.ArgumentParser, dest: str) -> None:
        parser.add_argument(
            self.name,
            dest=dest,
            action="store_false",
            default=_switch_from_env(self.env, True),
            help=f"{self.help} [env {self.env}=false].",
        )

    def value(
        self, parsed: argparse.Namespace, dest: str, earlier: Mapping[str, Any]
    ) -> Any:
        return getattr(parsed, dest)

    def table_rows(self) -> Tuple[TableRow, ...]:
        row = TableRow(
            flag=f"`{self.name}`",
            env=f"`{self.env}=false`",
            default=self.shown_default,
            what=self.readme,
        )
        return (row,)


def collector_switches() -> Mapping[str, bool]:
    """The field of every collector's on/off switch: collector name -> on."""
    return cast(Mapping[str, bool], _field(CollectorSwitches()))


def off_switch(
    name: str, *, env: str, help: str, readme: str, shown_default: str
) -> bool:
    """A field that is True unless `name` is given (or its variable is false)."""
    declared = OffSwitch(
        name=name, env=env, help=help, readme=readme, shown_default=shown_default
    )
    return cast(bool, _field(declared))


# --- the configuration -------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Config:
    """Every flag's value, in --help's and the README's order; built by parse_args only."""

    # Serving /metrics (exporter/exposition, wired in cli.py).
    listen: ListenAddress = flag(
        "--web.listen-address",
        parse_listen_address,
        default=":9841",
        help="Address to serve /metrics on; ':9841' and '[::]:9841' are every address, "
        "IPv6 and IPv4.",
    )
    telemetry_path: str = flag(
        "--web.telemetry-path",
        parse_url_path,
        default="/metrics",
        help="Path of the metrics page.",
    )
    web_config_file: Optional[str] = flag(
        "--web.config.file",
        parse_text,
        help="exporter-toolkit web config (YAML): TLS, client certificates, basic auth, "
        "headers; re-read on change.",
    )
    tls_cert_file: Optional[str] = flag(
        "--web.tls-cert-file",
        parse_text,
        help="Deprecated alias of tls_server_config.cert_file in --web.config.file: "
        "enables HTTPS.",
    )
    tls_key_file: Optional[str] = flag(
        "--web.tls-key-file",
        parse_text,
        help="Deprecated alias of tls_server_config.key_file in --web.config.file.",
    )
    tls_client_ca_file: Optional[str] = flag(
        "--web.tls-client-ca-file",
        parse_text,
        help="Deprecated alias of client_ca_file with client_auth_type "
        "RequireAndVerifyClientCert: mTLS.",
    )
    max_requests: int = flag(
        "--web.max-requests",
        parse_count,
        default="40",
        help="Requests answered at once (as node_exporter's); beyond them 503 at once.",
    )
    metric_opt_in_list: Tuple[str, ...] = repeatable_flag(
        "--metric-opt-in-list",
        parse_regex,
        help="Opt-in metric families to expose as well as the default set: regexes, each "
        "anchored and matched against a family's name (a counter's with or without "
        "_total), as kube-state-metrics'. Repeatable; its variable is a comma list, so a "
        "regex with a comma goes on the command line.",
    )
    metric_allowlist: Tuple[str, ...] = repeatable_flag(
        "--metric-allowlist",
        parse_regex,
        help="Of the default set and the opted-in families, expose only these (every other "
        "family goes, the alerts' too): regexes as --metric-opt-in-list's, as "
        "kube-state-metrics'. An opt-in family needs --metric-opt-in-list as well.",
    )
    metric_denylist: Tuple[str, ...] = repeatable_flag(
        "--metric-denylist",
        parse_regex,
        not_with="metric_allowlist",
        help="Of the default set and the opted-in families, expose all but these: regexes "
        "as --metric-opt-in-list's.",
    )

    # What is watched, and where the host's files are (exporter/host/paths.py).
    mode: str = flag(
        "--mode",
        one_of("sidecar", "node"),
        default="sidecar",
        help="sidecar: watch --shm.mount; node: also discover every pod's and container's "
        "shm from the host's mountinfo.",
    )
    procfs: str = flag(
        "--path.procfs", parse_text, default="/proc", help="procfs mount point."
    )
    sysfs: str = flag(
        "--path.sysfs", parse_text, default="/sys", help="sysfs mount point."
    )
    rootfs: str = flag(
        "--path.rootfs",
        parse_text,
        default="/",
        help="Root of the filesystem the shm mounts are found under.",
    )
    kmsg: str = flag(
        "--path.kmsg",
        parse_text,
        default="/dev/kmsg",
        help="The kernel log device the oom collector reads OOM kill reports from (not "
        "under --path.rootfs: in a container it is a device given to it, e.g. docker "
        "--device /dev/kmsg).",
    )
    shm_mounts: Tuple[str, ...] = repeatable_flag(
        "--shm.mount",
        parse_mount_point,
        default="/dev/shm",
        help="tmpfs mount to watch (repeatable; default /dev/shm).",
    )
    shm_size_limit: Optional[int] = flag(
        "--shm.size-limit",
        parse_size,
        help="Configured size limit of the shm volume (emptyDir sizeLimit), e.g. 16Gi.",
    )

    # How often sources run (exporter/runtime), and the segment inventory.
    poll_interval: float = flag(
        "--poll-interval",
        parse_duration,
        default="1s",
        help="How often cheap sources are polled.",
    )
    inventory_interval: float = flag(
        "--inventory-interval",
        parse_duration,
        default="15s",
        help="How often the full segment inventory runs (also on inotify events).",
    )
    peak_window: float = flag(
        "--peak-window",
        parse_duration,
        default="60s",
        help="Window of shmwatch_mount_peak_used_bytes.",
    )
    top_k: int = flag(
        "--segments.top-k",
        parse_count,
        default="10",
        help="How many segments and processes get their own series.",
    )
    ignore_unreadable: Optional[str] = flag(
        "--segments.ignore-unreadable",
        parse_regex,
        help="Regex on comm, anchored (it must match the whole name): root-owned processes "
        "whose /proc entries cannot be read but that hold no shm (a VM agent as pid 1 that "
        "even root cannot inspect) do not make held-by-nobody segments unverified.",
    )
    full_scan_interval: float = flag(
        "--segments.full-scan-interval",
        parse_duration_or_zero,
        default="2m",
        help="Node mode: how often every process on the node is read for the segments it "
        "holds, doubled (up to 8 times) while nothing changes and none is 'orphan'. In "
        "between, the inventory reads new processes, the pods of holders that exited and "
        "of mounts that moved while a segment there is 'orphan'; a new segment is its "
        "creator's ('linked'), one its pod's read finds unheld since the last full scan "
        "'unverified', until a full scan may call it 'orphan'. 0: every inventory run "
        "reads every process.",
    )
    max_segments: int = flag(
        "--inventory.max-segments",
        parse_count,
        default="150000",
        help="Per mount: past this many files the inventory keeps only their counts and "
        "bytes by class (state 'unverified', no names, no owners) and says so in "
        "shmwatch_inventory_degraded. Below it a file costs ~200 bytes: the default fits "
        "the sidecar manifest's 96 MiB limit.",
    )
    collector_timeout: float = flag(
        "--collector.timeout",
        parse_duration,
        default="10s",
        help="A collector run longer than this is marked failed.",
    )
    gpu_timeout: float = flag(
        "--collector.gpu.timeout",
        parse_duration,
        default="5s",
        help="Bound on one NVML sweep.",
    )

    # The workload's memory (exporter/collectors/cgroup.py, host_memory.py).
    cgroup_path: Optional[str] = flag(
        "--cgroup.path",
        parse_text,
        help="Memory cgroup to watch, as in /proc/<pid>/cgroup (e.g. /kubepods/pod1) or a "
        "directory under sysfs.",
    )
    cgroup_target_process: Optional[str] = flag(
        "--cgroup.target-process",
        parse_regex,
        not_with="cgroup_path",
        help="Watch the cgroup of the first process whose comm or cmdline matches this "
        "regex.",
    )
    memory_limit_bytes: Optional[int] = flag(
        "--memory.limit-bytes",
        parse_size,
        help="Memory limit of the workload (Downward API limits.memory); used where tighter "
        "than the cgroup's, ignored at or above the host's MemTotal.",
    )

    # Logging (cli.py).
    log_level: str = flag(
        "--log.level",
        parse_log_level,
        default="info",
        help="debug, info, warning or error.",
    )
    log_format: str = flag(
        "--log.format",
        one_of("logfmt", "json"),
        default="logfmt",
        help="logfmt or json (one JSON object a line).",
    )

    # Switches.
    collectors: Mapping[str, bool] = collector_switches()
    inotify: bool = off_switch(
        "--no-inotify",
        env="SHMWATCH_INOTIFY",
        help="Poll instead of watching mounts with inotify",
        readme="Poll mounts instead of watching them.",
        shown_default="inotify on",
    )


def declarations() -> Tuple[Tuple[str, Declaration], ...]:
    """(Config field, how it is given), in Config's order."""
    return tuple((f.name, f.metadata[DECLARATION]) for f in fields(Config))


def table_rows() -> Tuple[TableRow, ...]:
    """The README's flags table, a row per flag (docs/generate.py)."""
    return tuple(row for _, declared in declarations() for row in declared.table_rows())


# --- the command line -------------------------------------------------------------------------


class FlagParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line naming it (no usage dump), exit 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(prog: str = PROG) -> FlagParser:
    """Every flag of Config, and --version; `shmwatch check` adds its own to it."""
    from exporter import __version__

    parser = FlagParser(prog=prog, description=DESCRIPTION, allow_abbrev=False)
    parser.add_argument(
        "--version", action="version", version=f"shmwatch {__version__}"
    )
    for dest, declared in declarations():
        declared.add_to(parser, dest)
    return parser


def bad_flag(flag: str, message: str, prog: str = PROG) -> NoReturn:
    """Ends the process as a bad flag value does: one line naming the flag, exit 2."""
    FlagParser(prog=prog).error(f"argument {flag}: {message}")


def _conflict(values: Mapping[str, Any]) -> Optional[str]:
    """The first pair of fields given together that `not_with` forbids, as a message."""
    for dest, declared in declarations():
        if isinstance(declared, Flag) and declared.not_with:
            if values[dest] and values[declared.not_with]:
                other = _flag_of(declared.not_with)
                return f"arguments {other.name} and {declared.name}: give one, not both"
    return None


def _no_family_left(values: Mapping[str, Any]) -> Optional[str]:
    """A message if the allow- or denylist leaves no metric family at all: an exporter that
    serves an empty page is up to Prometheus while every alert is silently absent."""
    selection = MetricSelection(
        allowlist=values["metric_allowlist"],
        denylist=values["metric_denylist"],
        opt_in=values["metric_opt_in_list"],
    )
    if selection.exposed():
        return None
    dest = "metric_allowlist" if selection.allowlist else "metric_denylist"
    return f"argument {_flag_of(dest).name}: leaves no metric family to expose"


def _flag_of(dest: str) -> "Flag[Any]":
    """The flag that gives Config's field `dest`."""
    declared = dict(declarations())[dest]
    assert isinstance(declared, Flag), f"{dest} is not a flag"
    return declared


def config_from(parsed: argparse.Namespace) -> Config:
    """The Config of what argparse parsed, the environment and the defaults; FlagError if a
    variable's value is bad, two flags conflict, or the metric lists leave no family."""
    values: Dict[str, Any] = {}
    for dest, declared in declarations():
        values[dest] = declared.value(parsed, dest, values)
    conflict = _conflict(values) or _no_family_left(values)
    if conflict:
        raise FlagError(conflict)
    return Config(**values)


@overload
def parse_args(argv: Optional[Sequence[str]] = None) -> Config: ...


@overload
def parse_args(
    argv: Optional[Sequence[str]], parser: argparse.ArgumentParser
) -> Tuple[Config, argparse.Namespace]: ...


def parse_args(
    argv: Optional[Sequence[str]] = None,
    parser: Optional[argparse.ArgumentParser] = None,
) -> Any:
    """-> Config; with a parser of the caller's (build_parser's, with arguments of its own
    added): (Config, the namespace, where the caller's arguments are). A bad flag or
    variable ends the process through the parser's error()."""
    own_parser = parser is None
    parser = parser or build_parser()
    parsed = parser.parse_args(argv)
    try:
        cfg = config_from(parsed)
    except FlagError as err:
        parser.error(str(err))
    return cfg if own_parser else (cfg, parsed)
