"""The mutation score of shmwatch's decisions, from mutmut 3's results.

    rm -rf mutants && python3 bench/mutation_score.py --run [--min 90]
    rm -rf mutants && python3 bench/mutation_score.py --modules [--min 85]
    python3 bench/mutation_score.py --modules --module exporter/collectors/sysv.py

Two scores, over two lists in pyproject.toml [tool.shmwatch.mutation]:

- `pure` (--run; without --run or --modules, the results of an earlier `mutmut run` are
  scored): the listed functions' mutants only (by name: mutmut mutates whole files, and the
  other functions in them would cost the run as much again without counting). Exits 1 when
  a listed function has no mutants at all (renamed, moved, or decorated: mutmut leaves
  decorated functions whole), so the list stays true.
- `modules` (--modules): every mutant of each listed module, impure code included (the
  collectors reading /proc and cgroupfs, the watcher's event handling, `check`'s report):
  mutmut is run on them (--module: only those, while developing), and a table per module
  is printed, then the survivors' largest groups, and last `N/M mutants killed over K
  modules (P %)`. Only the mutants EXCLUDED below (named patterns, each with its reason)
  are left out of it, and how many is said.

A mutant with no covering test counts as surviving; one that times out (an endless loop)
as killed. Exits 1 below --min. mutmut runs under `nice -n 15`, --max-children at a time:
the machines are shared.
"""

import argparse
import ast
import collections
import fnmatch
import os
import re
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from typing import Counter, Dict, List, Optional, Set

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NICE = ["nice", "-n", "15"]
KILLED = ("killed", "timeout")  # a mutant that loops forever is caught by the timeout


@dataclass(frozen=True)
class Exclusion:
    """Mutants of `functions` (a glob on module.function) whose mutated line matches `changed`
    (a regex on the diff's '+' line), or, with `changed` None, whose every mutated line is
    within a call to a logger (log.info(...)): equivalent, or a log message's text alone."""

    name: str
    functions: str
    changed: Optional[str]
    reason: str


# Left out of the --modules score, and counted. Never a whole function or module: a pattern
# names the mutated line's text, and says why no test can (or should) tell it apart.
EXCLUDED = [
    Exclusion(
        "log message",
        "*",
        None,
        "a call to a logger (log.debug(...)): only the text of a log line changes (SaidOnce's"
        " messages, and what is said in findings and errors, are tested word for word)",
    ),
    Exclusion(
        "said-once key",
        "exporter.inventory.holdings.UnprovenLog.say",
        r'self\._said\.say\((None|"XXunprovenXX"|"UNPROVEN"),',
        "the key under which the log remembers what it said: any constant is one key",
    ),
    Exclusion(
        "digits placeholder",
        "exporter.inventory.holdings.UnprovenLog.say",
        r're\.sub\(r"\\d\+", "XX#XX"',
        "what stands for pids and counts when reasons are compared: never shown",
    ),
    Exclusion(
        "float('-INF')",
        "*",
        r'float\("-INF"\)',
        "float() reads infinity in any case",
    ),
    Exclusion(
        "codec name case",
        "*",
        r'\.decode\("UTF-8"',
        "codec names are case-insensitive",
    ),
    Exclusion(
        "reaper guard",
        "exporter.collectors.oom.parse_oom_kills",
        r'"(XXreaped processXX|REAPED PROCESS)" not in message',
        "the oom_reaper's 'reaped process' line never matches 'Killed process' anyway",
    ),
]
LOGGERS = {"log", "LOG", "logger"}  # module-level loggers' names
LOGGER_METHODS = {"debug", "info", "warning", "error", "exception", "critical", "log"}


def function_of(mutant: str) -> str:
    """'exporter.config.x_parse_size__mutmut_3' -> 'exporter.config.parse_size';
    'exporter.m.xǁClsǁmeth__mutmut_1' -> 'exporter.m.Cls.meth'."""
    base = mutant.rsplit("__mutmut_", 1)[0]
    module, _, name = base.rpartition(".")
    if name.startswith("xǁ"):
        name = ".".join(name[2:].split("ǁ"))
    elif name.startswith("x_"):
        name = name[2:]
    return f"{module}.{name}"


def module_of(mutant: str) -> str:
    """'exporter.m.xǁClsǁmeth__mutmut_1' -> 'exporter.m'."""
    return mutant.rsplit("__mutmut_", 1)[0].rpartition(".")[0]


def dotted(path: str) -> str:
    """'exporter/host/cgroupfs.py' -> 'exporter.host.cgroupfs'."""
    return path.removesuffix(".py").replace("/", ".")


def mutant_glob(function: str) -> str:
    """function_of's inverse, as a glob: 'exporter.m.Cls.meth' (a capitalised class name)
    -> 'exporter.m.xǁClsǁmeth__mutmut_*'; 'exporter.m.f' -> 'exporter.m.x_f__mutmut_*'."""
    parts = function.split(".")
    if parts[-2][:1].isupper():
        return f"{'.'.join(parts[:-2])}.xǁ{parts[-2]}ǁ{parts[-1]}__mutmut_*"
    return f"{'.'.join(parts[:-1])}.x_{parts[-1]}__mutmut_*"


def run_mutmut(globs: List[str], max_children: int) -> float:
    """`mutmut run` on the mutants these globs name; -> its wall time in seconds."""
    started = time.monotonic()
    # A name that matches no mutant stops mutmut ("nothing matches"); one unmatched glob
    # among others does not, and is reported by the caller as having no mutants.
    run = [*NICE, "mutmut", "run", "--max-children", str(max_children)]
    subprocess.run(run + sorted(globs), cwd=REPO, check=True)
    return time.monotonic() - started


def results() -> Dict[str, str]:
    """Every mutant's status, by name."""
    out = subprocess.run(
        ["mutmut", "results", "--all", "true"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    found = {}
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep:
            found[name] = status
    return found


def print_total(done: Counter[str], n: int, over: str) -> float:
    killed = sum(done[s] for s in KILLED)
    score = 100.0 * killed / n if n else 0.0
    without = 100.0 * done["killed"] / n if n else 0.0
    print(
        f"({done['timeout']} that time out, an endless loop, counted as killed;"
        f" {without:.1f} % without them)"
    )
    print(f"{killed}/{n} mutants killed over {over} ({score:.1f} %)")
    return score


def score_pure(pure: Set[str], statuses: Dict[str, str], minimum: float) -> int:
    by_function: Dict[str, Counter[str]] = collections.defaultdict(collections.Counter)
    for name, status in statuses.items():
        if function_of(name) in pure:
            by_function[function_of(name)][status] += 1
    missing = sorted(pure - by_function.keys())
    total: Counter[str] = collections.Counter()
    for function in sorted(by_function):
        counts = by_function[function]
        total += counts
        print(row(function, counts, 55))
    if total["not checked"]:
        print(
            f"{total['not checked']} not checked: the run did not finish",
            file=sys.stderr,
        )
    if missing:
        print(
            f"no mutants for: {', '.join(missing)} (renamed or moved? update"
            " [tool.shmwatch.mutation])",
            file=sys.stderr,
        )
    print()
    n = sum(total.values())
    score = print_total(total, n, f"{len(by_function)} functions")
    return 1 if score < minimum or missing else 0


def row(name: str, counts: Counter[str], width: int) -> str:
    n = sum(counts.values())
    killed = sum(counts[s] for s in KILLED)
    rest = "  ".join(f"{s}: {c}" for s, c in sorted(counts.items()) if s not in KILLED)
    percent = 100.0 * killed / n if n else 0.0
    return f"{name:<{width}} {killed:>5}/{n:<5} {percent:5.1f} %  {rest}"


def changed_lines(diff: str, sign: str) -> List[str]:
    """The diff's removed ('-') or added ('+') lines, without the sign."""
    return [
        line[1:]
        for line in diff.splitlines()
        if line[:1] == sign and line[:3] != sign * 3
    ]


def function_node(mutant: str) -> Optional[ast.FunctionDef]:
    """The mutated function's definition in the original module."""
    module = module_of(mutant)
    with open(os.path.join(REPO, *module.split(".")) + ".py") as f:
        tree = ast.parse(f.read())
    *classes, name = function_of(mutant)[len(module) + 1 :].split(".")
    body: List[ast.stmt] = tree.body
    for cls in classes:
        body = next(
            (n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), []
        )
    return next(
        (n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None
    )


def in_logger_call(mutant: str, diff: str) -> bool:
    """Whether every line the mutant changed is within a call to a logger's method."""
    node = function_node(mutant)
    if node is None:
        return False
    with open(os.path.join(REPO, *module_of(mutant).split(".")) + ".py") as f:
        source = f.read().splitlines()
    calls = [
        (call.lineno, call.end_lineno or call.lineno)
        for call in ast.walk(node)
        if isinstance(call, ast.Call)
        and isinstance(call.func, ast.Attribute)
        and call.func.attr in LOGGER_METHODS
        and isinstance(call.func.value, ast.Name)
        and call.func.value.id in LOGGERS
    ]
    span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
    removed = {line.strip() for line in changed_lines(diff, "-")}
    lines = [i for i in span if source[i - 1].strip() in removed]
    return bool(lines) and all(any(a <= i <= b for a, b in calls) for i in lines)


def excluded_by(mutant: str, diff: str) -> Optional[Exclusion]:
    added = changed_lines(diff, "+")
    for rule in EXCLUDED:
        if not fnmatch.fnmatch(function_of(mutant), rule.functions):
            continue
        if rule.changed is None and in_logger_call(mutant, diff):
            return rule
        if rule.changed is not None and any(
            re.search(rule.changed, line) for line in added
        ):
            return rule
    return None


def diff_of(mutant: str) -> str:
    """The mutant's diff, as `mutmut show` prints it (mutmut's own function, in-process)."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant

    return get_diff_for_mutant(mutant)


def score_modules(
    modules: List[str],
    statuses: Dict[str, str],
    args: argparse.Namespace,
    seconds: float,
) -> int:
    wanted = {dotted(m) for m in modules}
    by_module: Dict[str, Counter[str]] = {
        m: collections.Counter() for m in sorted(wanted)
    }
    left_out: Counter[str] = collections.Counter()
    survivors: Dict[str, List[str]] = collections.defaultdict(list)
    cwd = os.getcwd()
    os.chdir(REPO)  # mutmut reads mutants/ from the working directory
    try:
        for name, status in sorted(statuses.items()):
            module = module_of(name)
            if module not in wanted:
                continue
            if status not in KILLED:
                rule = excluded_by(name, diff_of(name))
                if rule is not None:
                    left_out[rule.name] += 1
                    continue
                survivors[function_of(name)].append(name)
            by_module[module][status] += 1
    finally:
        os.chdir(cwd)
    total: Counter[str] = collections.Counter()
    for module, counts in by_module.items():
        total += counts
        print(row(module, counts, 40))
    empty = [m for m, counts in by_module.items() if not counts]
    print()
    print("largest groups of survivors (function: mutants not killed):")
    for function, names in sorted(
        survivors.items(), key=lambda kv: (-len(kv[1]), kv[0])
    )[: args.survivors]:
        print(f"  {function}: {len(names)}")
    rules = {rule.name: rule for rule in EXCLUDED}
    print(f"excluded: {sum(left_out.values())} mutant(s)")
    for name, count in sorted(left_out.items()):
        print(f"  {count} {name}: {rules[name].reason}")
    if total["not checked"]:
        print(
            f"{total['not checked']} not checked: the run did not finish",
            file=sys.stderr,
        )
    if empty:
        print(
            f"no mutants for: {', '.join(empty)} (moved? update [tool.shmwatch.mutation])",
            file=sys.stderr,
        )
    if seconds:
        print(
            f"mutmut ran {seconds / 60:.1f} min wall, {args.max_children} at a time (generation and stats included)"
        )
    n = sum(total.values())
    score = print_total(total, n, f"{len(by_module)} modules")
    return 1 if score < args.min or empty else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--min", type=float, default=0.0, help="fail below this percentage killed"
    )
    parser.add_argument(
        "--run",
        action="store_true",
        help="run mutmut on the listed pure functions first",
    )
    parser.add_argument(
        "--modules",
        action="store_true",
        help="run mutmut on the listed modules, and score them",
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        metavar="PATH",
        help="with --modules: only this one (repeatable), e.g. exporter/collectors/sysv.py",
    )
    parser.add_argument(
        "--no-run",
        action="store_true",
        help="with --modules: score the last run's results, without running mutmut",
    )
    parser.add_argument(
        "--max-children", type=int, default=2, help="mutmut's parallel test runs"
    )
    parser.add_argument(
        "--survivors",
        type=int,
        default=12,
        help="--modules: how many groups of survivors to list",
    )
    args = parser.parse_args()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        tool = tomllib.load(f)["tool"]
    listed = tool["shmwatch"]["mutation"]
    if args.modules:
        modules = args.module or listed["modules"]
        unmutated = sorted(set(modules) - set(tool["mutmut"]["only_mutate"]))
        if unmutated:
            sys.exit(f"not in [tool.mutmut] only_mutate: {', '.join(unmutated)}")
        seconds = (
            0.0
            if args.no_run
            else run_mutmut([f"{dotted(m)}.*" for m in modules], args.max_children)
        )
        return score_modules(modules, results(), args, seconds)
    if args.run:
        run_mutmut([mutant_glob(f) for f in listed["pure"]], args.max_children)
    return score_pure(set(listed["pure"]), results(), args.min)


if __name__ == "__main__":
    sys.exit(main())
