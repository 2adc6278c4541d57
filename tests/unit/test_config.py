"""exporter/config.py: each field of Config is one declaration, and every flag gets from it
its --help line, its SHMWATCH_ variable, its README row and its value; a bad one is one line
naming it, exit 2. The tests run over every declared flag, so a flag added later is held to
the same (the tests below and the README test hold the flags by name)."""

import argparse
import dataclasses
import math
import re
from typing import Callable, Dict, List, Tuple

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from exporter import config
from exporter.config import (
    CollectorSwitches,
    Config,
    Flag,
    ListenAddress,
    OffSwitch,
    build_parser,
    declarations,
    parse_args,
    parse_duration,
    parse_duration_or_zero,
    parse_listen_address,
    parse_size,
)
from tests.helpers import any_text

FLAGS: List[Tuple[str, "Flag[object]"]] = [(dest, d) for dest, d in declarations() if isinstance(d, Flag)]
# Two good texts and a bad one (None: every text is good) for each parser a flag uses. A new
# parser needs a line here: the KeyError in sample() says which.
SAMPLES: Dict[Callable[[str], object], Tuple[str, str, object]] = {
    config.parse_text: ("/a", "/b", None),
    config.parse_mount_point: ("/a/", "/b", "dev/shm"),
    config.parse_url_path: ("/a", "/b", "a"),
    config.parse_listen_address: ("127.0.0.1:1", "[::1]:2", "nowhere"),
    config.parse_count: ("3", "4", "0"),
    config.parse_size: ("1Gi", "2g", "lots"),
    config.parse_duration: ("2s", "1m", "0s"),
    config.parse_duration_or_zero: ("0", "1m", "-1s"),
    config.parse_regex: ("shmwatch_build_info", "vllm|shmwatch_mount_.*", "("),  # comms; families too
    config.parse_log_level: ("DEBUG", "error", "loud"),
}


def sample(flag: "Flag[object]") -> Tuple[str, str, object]:
    if isinstance(flag.parse, config.OneOf):
        return flag.parse.choices[-1], flag.parse.choices[0], "nonesuch"
    return SAMPLES[flag.parse]


def parsed_as(flag: "Flag[object]", text: str) -> object:
    if flag.repeatable:
        return tuple(dict.fromkeys(flag.parse(t) for t in text.split(",")))
    return flag.parse(text)


@pytest.fixture
def clean_env(monkeypatch):
    """No SHMWATCH_ variable of the machine's leaks into a test."""
    for dest, declared in declarations():
        for row in declared.table_rows():
            monkeypatch.delenv(row.env.strip("`").split("=")[0], raising=False)
    return monkeypatch


def test_every_field_of_config_is_declared_once():
    names = [f.name for f in dataclasses.fields(Config)]
    assert [dest for dest, _ in declarations()] == names
    options = [o for a in build_parser()._actions for o in a.option_strings]
    assert len(options) == len(set(options)), "a flag declared twice"
    envs = [row.env for _, d in declarations() for row in d.table_rows()]
    assert len(envs) == len(set(envs)), "two flags read one variable"
    assert all(re.fullmatch(r"`SHMWATCH_[A-Z0-9_]+(=false)?`", env) for env in envs), envs


@pytest.mark.parametrize("dest,flag", FLAGS, ids=[f.name for _, f in FLAGS])
def test_a_default_is_a_value_the_flag_takes(dest, flag):
    if flag.default is not None:
        assert getattr(parse_args([]), dest) == parsed_as(flag, flag.default)


@pytest.mark.parametrize("dest,flag", FLAGS, ids=[f.name for _, f in FLAGS])
def test_every_flag_is_read_from_its_variable_and_the_command_line_wins(clean_env, dest, flag):
    from_env, given, _ = sample(flag)
    clean_env.setenv(flag.env, from_env if not flag.repeatable else f"{from_env},{given}")
    expected = parsed_as(flag, from_env if not flag.repeatable else f"{from_env},{given}")
    assert getattr(parse_args([]), dest) == expected
    assert getattr(parse_args([f"{flag.name}={given}"]), dest) == parsed_as(flag, given)


REFUSING = [(dest, flag) for dest, flag in FLAGS if sample(flag)[2] is not None]  # not every text is a path


@pytest.mark.parametrize("dest,flag", REFUSING, ids=[f.name for _, f in REFUSING])
def test_a_bad_value_is_one_line_naming_the_flag_and_exit_2(clean_env, capsys, dest, flag):
    bad = sample(flag)[2]
    with pytest.raises(SystemExit) as given:
        parse_args([f"{flag.name}={bad}"])
    err = capsys.readouterr().err
    assert given.value.code == 2 and err.startswith(f"shmwatch: error: argument {flag.name}: ")
    assert err.count("\n") == 1, err
    clean_env.setenv(flag.env, str(bad))
    with pytest.raises(SystemExit) as from_env:
        parse_args([])
    err = capsys.readouterr().err
    assert from_env.value.code == 2, err
    assert err.startswith(f"shmwatch: error: argument {flag.name} (from {flag.env}): ") and err.count("\n") == 1


def test_every_flag_is_in_help_with_its_variable():
    text = build_parser().format_help()
    for dest, declared in declarations():
        for row in declared.table_rows():
            for option in re.findall(r"`(--[^`]+)`", row.flag):
                assert option in text, option
            assert f"[env {row.env.strip('`')}]" in " ".join(text.split()), row.env


def test_a_repeatable_flag_keeps_each_value_once_in_order(clean_env):
    cfg = parse_args(["--shm.mount=/a", "--shm.mount=/b/", "--shm.mount=/a/"])
    assert cfg.shm_mounts == ("/a", "/b")
    clean_env.setenv("SHMWATCH_SHM_MOUNT", "/b,/a,/b/")
    assert parse_args([]).shm_mounts == ("/b", "/a")


def test_an_empty_regex_is_refused_one_line_exit_2(clean_env, capsys):
    """`--metric-allowlist=` was a list of one empty regex: given, matching no family, so
    /metrics showed nothing at all; an empty --segments.ignore-unreadable excused every
    process."""
    for flag in ("--metric-allowlist", "--metric-denylist", "--segments.ignore-unreadable",
                 "--cgroup.target-process"):
        with pytest.raises(SystemExit) as ended:
            parse_args([f"{flag}="])
        err = capsys.readouterr().err
        assert ended.value.code == 2 and err.startswith(f"shmwatch: error: argument {flag}: "), err
        assert "empty regex" in err and err.count("\n") == 1, err


def test_a_comma_list_variable_is_stripped_and_one_with_no_item_is_not_given(clean_env):
    clean_env.setenv("SHMWATCH_METRIC_ALLOWLIST", " shmwatch_build_info, shmwatch_mount_used_bytes,,")
    assert parse_args([]).metric_allowlist == ("shmwatch_build_info", "shmwatch_mount_used_bytes")
    for empty in ("", " ", ", ,"):
        clean_env.setenv("SHMWATCH_METRIC_ALLOWLIST", empty)
        assert parse_args([]).metric_allowlist == (), repr(empty)
        clean_env.setenv("SHMWATCH_SHM_MOUNT", empty)
        assert parse_args([]).shm_mounts == ("/dev/shm",), repr(empty)  # its default
    clean_env.setenv("SHMWATCH_METRIC_DENYLIST", "")  # an empty variable does not conflict
    assert parse_args(["--metric-allowlist=shmwatch_build_info"]).metric_denylist == ()
    # Any flag's empty variable is one not given (kingpin's): the tests' strict owner view.
    clean_env.setenv("SHMWATCH_SEGMENTS_IGNORE_UNREADABLE", "")
    clean_env.setenv("SHMWATCH_WEB_LISTEN_ADDRESS", "")
    cfg = parse_args([])
    assert cfg.ignore_unreadable is None and cfg.listen == parse_args(["--web.listen-address=:9841"]).listen


def test_metric_lists_that_leave_no_family_are_one_line_exit_2(clean_env, capsys):
    """An exporter that serves an empty page is `up` while every alert is absent."""
    for argv, env, flag in ((["--metric-allowlist=nope"], None, "--metric-allowlist"),
                            (["--metric-allowlist=shmwatch_mount_inodes"], None, "--metric-allowlist"),  # opt-in
                            (["--metric-denylist=.*"], None, "--metric-denylist"),
                            (["--metric-denylist=shmwatch_.*", "--metric-denylist=process_.*"], None, "--metric-denylist"),
                            ([], ("SHMWATCH_METRIC_DENYLIST", "shmwatch_.*, process_.*"), "--metric-denylist")):
        if env:
            clean_env.setenv(*env)
        with pytest.raises(SystemExit) as ended:
            parse_args(argv)
        err = capsys.readouterr().err
        assert ended.value.code == 2, argv
        assert err == f"shmwatch: error: argument {flag}: leaves no metric family to expose\n", err
    clean_env.delenv("SHMWATCH_METRIC_DENYLIST")
    cfg = parse_args(["--metric-allowlist=shmwatch_mount_inodes", "--metric-opt-in-list=shmwatch_mount_inodes"])
    assert cfg.metric_allowlist == cfg.metric_opt_in_list == ("shmwatch_mount_inodes",)
    assert parse_args(["--metric-denylist=shmwatch_.*"]).metric_denylist == ("shmwatch_.*",)  # process_ left


def test_the_collector_switches_and_no_inotify(clean_env):
    switches = dict(declarations())["collectors"]
    assert isinstance(switches, CollectorSwitches) and isinstance(dict(declarations())["inotify"], OffSwitch)
    names = switches.names()
    assert {"shm_mount", "segments", "gpu", "oom"} <= set(names) and "process" not in names  # no switch
    assert parse_args([]).inotify is True and parse_args(["--no-inotify"]).inotify is False
    for off in ("false", "0", "OFF", " no "):
        clean_env.setenv("SHMWATCH_INOTIFY", off)
        assert parse_args([]).inotify is False, off
    for on in ("true", "1", "banana", ""):  # only a word for off turns it off
        clean_env.setenv("SHMWATCH_INOTIFY", on)
        assert parse_args([]).inotify is True, on
    assert parse_args(["--no-inotify"]).inotify is False  # the flag wins
    clean_env.setenv("SHMWATCH_COLLECTOR_OOM", "true")
    assert parse_args([]).collectors["oom"] is True  # on in a sidecar too
    clean_env.setenv("SHMWATCH_COLLECTOR_OOM", "false")
    clean_env.setenv("SHMWATCH_MODE", "node")
    assert parse_args([]).collectors["oom"] is False
    assert parse_args(["--collector.oom"]).collectors["oom"] is True  # the flag wins


def test_config_is_frozen_through_and_through():
    cfg = parse_args([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.poll_interval = 2.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        cfg.collectors["gpu"] = False  # type: ignore[index]
    assert isinstance(cfg.shm_mounts, tuple)
    with pytest.raises(TypeError):
        Config(mode="node")  # type: ignore[call-arg]  # built whole, by parse_args


def test_two_flags_that_exclude_each_other(clean_env, capsys):
    with pytest.raises(SystemExit) as both:
        parse_args(["--cgroup.target-process=vllm"] + ["--cgroup.path=/a"])
    assert both.value.code == 2
    assert capsys.readouterr().err == (
        "shmwatch: error: arguments --cgroup.path and --cgroup.target-process: give one, not both\n")
    # not_with is for flags without a default: one with a default is always given.
    with pytest.raises(ValueError, match="always given"):
        Flag(name="--x", parse=config.parse_text, help="x", default="a", not_with="cgroup_path")


def test_a_caller_adds_its_own_flags_and_gets_them_back(clean_env):
    # shmwatch check: build_parser(prog), its flags added, then (Config, namespace).
    parser = build_parser(prog="shmwatch check")
    parser.add_argument("--extra", default="e")
    cfg, namespace = parse_args(["--mode=node", "--extra=f"], parser=parser)
    assert cfg.mode == "node" and namespace.extra == "f"
    assert isinstance(namespace, argparse.Namespace)


def test_a_bad_flag_after_parsing_is_the_same_one_line(capsys):
    with pytest.raises(SystemExit) as ended:
        config.bad_flag("--web.listen-address", "cannot listen on :1: Permission denied")
    assert ended.value.code == 2
    assert capsys.readouterr().err == (
        "shmwatch: error: argument --web.listen-address: cannot listen on :1: Permission denied\n")


BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
DECIMAL = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30,  # docker's --shm-size: lower case is binary
           "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}


@given(st.integers(0, 1 << 20), st.sampled_from(sorted({**BINARY, **DECIMAL, "": 1})), st.sampled_from(["", "B", "b"]))
def test_size_kubernetes_and_docker_forms(number, suffix, byte):
    factor = {**BINARY, **DECIMAL, "": 1}[suffix]
    assert parse_size(f"{number}{suffix}{byte if suffix else ''}") == number * factor


@given(any_text)
@example("9" * 400)
@example("9" * 400 + "Gi")
def test_size_any_text_raises_only_value_error(text):
    try:
        result = parse_size(text)
    except ValueError:
        return
    assert isinstance(result, int) and result >= 0


GO_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


@given(st.integers(1, 10 ** 6), st.sampled_from(sorted(GO_UNITS) + [""]))
def test_duration_single_unit_forms(number, unit):
    assert parse_duration(f"{number}{unit}") == pytest.approx(number * GO_UNITS.get(unit, 1))


@given(st.integers(0, 48), st.integers(0, 59), st.integers(0, 59))
def test_duration_go_compound_forms_parse_or_are_refused(h, m, s):
    # Go's time.ParseDuration (Prometheus' flags) also takes "1h30m"; shmwatch takes one
    # unit per value. A compound form must not be misread: the right value or a ValueError.
    text = f"{h}h{m}m{s}s"
    try:
        got = parse_duration(text)
    except ValueError as err:
        assert "invalid duration" in str(err)
        return
    assert got == h * 3600 + m * 60 + s


@given(any_text)
@example("9" * 400)
@example("0")
@example("0.0ms")
def test_duration_any_text_raises_only_value_error(text):
    try:
        result = parse_duration(text)
    except ValueError:
        return
    assert math.isfinite(result) and result > 0


@pytest.mark.parametrize("text,seconds", [("500ms", 0.5), ("15s", 15), ("1m", 60), ("2h", 7200), ("3", 3)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["abc", "", "0s", "-1s", "5 parsecs"])
def test_bad_durations(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_a_full_scan_interval_may_be_zero_and_nothing_below():
    assert parse_duration_or_zero("0s") == parse_duration_or_zero("0") == 0
    assert parse_duration_or_zero("2m") == 120
    for bad in ("-1s", "abc", ""):
        with pytest.raises(ValueError):
            parse_duration_or_zero(bad)
    assert parse_args(["--segments.full-scan-interval=0s"]).full_scan_interval == 0


@pytest.mark.parametrize("text,size", [
    ("64Mi", 64 << 20), ("16Gi", 16 << 30), ("2g", 2 << 30), ("512k", 512 << 10), ("1048576", 1048576),
    ("1G", 10 ** 9), ("80Gi", 80 << 30), ("1.5Gi", 3 << 29),
])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_listen_address():
    assert parse_listen_address(":9841") == ListenAddress(host="", port=9841)  # every address, IPv6 and IPv4
    assert parse_listen_address("[::]:9841") == ListenAddress(host="::", port=9841)
    assert parse_listen_address("0.0.0.0:9841") == ListenAddress(host="0.0.0.0", port=9841)
    assert parse_listen_address("127.0.0.1:0") == ListenAddress(host="127.0.0.1", port=0)
    assert parse_listen_address("[::1]:9841") == ListenAddress(host="::1", port=9841)
    for bad in ("9841x", "::1:9841", "[::1:9841", "localhost:99999"):
        with pytest.raises(ValueError):
            parse_listen_address(bad)


def test_defaults():
    cfg = parse_args([])
    assert (cfg.listen, cfg.telemetry_path) == (ListenAddress(host="", port=9841), "/metrics")
    assert cfg.shm_mounts == ("/dev/shm",)
    assert (cfg.poll_interval, cfg.inventory_interval, cfg.peak_window) == (1.0, 15.0, 60.0)
    # Every collector on, but the kernel log's: a sidecar has no /dev/kmsg. Node mode reads it.
    assert {name for name, on in cfg.collectors.items() if not on} == {"oom"}
    assert parse_args(["--mode=node"]).collectors["oom"] is True
    assert parse_args(["--mode=node", "--no-collector.oom"]).collectors["oom"] is False
    assert parse_args(["--collector.oom"]).collectors["oom"] is True


def test_flags_and_env(monkeypatch):
    monkeypatch.setenv("SHMWATCH_POLL_INTERVAL", "250ms")
    monkeypatch.setenv("SHMWATCH_SHM_MOUNT", "/dev/shm,/mnt/dshm")
    monkeypatch.setenv("SHMWATCH_MEMORY_LIMIT_BYTES", "32Gi")
    monkeypatch.setenv("SHMWATCH_COLLECTOR_GPU", "false")
    cfg = parse_args(["--inventory-interval=1m", "--no-collector.sysv", "--shm.size-limit=16Gi"])
    assert cfg.poll_interval == 0.25 and cfg.inventory_interval == 60
    assert cfg.shm_mounts == ("/dev/shm", "/mnt/dshm")
    assert cfg.memory_limit_bytes == 32 << 30 and cfg.shm_size_limit == 16 << 30
    assert cfg.collectors["gpu"] is False and cfg.collectors["sysv"] is False and cfg.collectors["segments"]
    # The command line wins over the environment.
    assert parse_args(["--poll-interval=2s", "--shm.mount=/x"]).poll_interval == 2.0
    assert parse_args(["--shm.mount=/x"]).shm_mounts == ("/x",)
