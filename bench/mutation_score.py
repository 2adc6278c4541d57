"""The mutation score over shmwatch's pure functions, from `mutmut results --all true`.

    rm -rf mutants && python3 bench/mutation_score.py --run [--min 90]

--run first runs `mutmut run` on the listed functions' mutants only (by name: mutmut mutates
whole files, and the other functions in them would cost the run as much again without
counting); without it, the results of an earlier `mutmut run` are scored.

mutmut mutates whole files (pyproject.toml [tool.mutmut] only_mutate), and some of those
files also hold collectors that read /proc; the pure functions whose score counts are
listed in [tool.shmwatch.mutation] pure. A mutant with no covering test counts as
surviving; one that times out (an endless loop) as killed. Prints a table per function and
the total; exits 1 below --min, and when a listed function has no mutants at all (renamed,
moved, or decorated: mutmut leaves decorated functions whole), so the list stays true.
"""
import argparse
import collections
import os
import subprocess
import sys
import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def mutant_glob(function: str) -> str:
    """function_of's inverse, as a glob: 'exporter.m.Cls.meth' (a capitalised class name)
    -> 'exporter.m.xǁClsǁmeth__mutmut_*'; 'exporter.m.f' -> 'exporter.m.x_f__mutmut_*'."""
    parts = function.split(".")
    if parts[-2][:1].isupper():
        return f"{'.'.join(parts[:-2])}.xǁ{parts[-2]}ǁ{parts[-1]}__mutmut_*"
    return f"{'.'.join(parts[:-1])}.x_{parts[-1]}__mutmut_*"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", type=float, default=0.0, help="fail below this percentage killed")
    parser.add_argument("--run", action="store_true", help="run mutmut on the listed functions first")
    parser.add_argument("--max-children", type=int, default=2, help="mutmut's parallel test runs")
    args = parser.parse_args()
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        pure = set(tomllib.load(f)["tool"]["shmwatch"]["mutation"]["pure"])
    if args.run:
        run = ["nice", "mutmut", "run", "--max-children", str(args.max_children)]
        # A name that matches no mutant stops mutmut ("nothing matches"); one unmatched
        # glob among others does not, and is reported below as having no mutants.
        subprocess.run(run + sorted(map(mutant_glob, pure)), cwd=REPO, check=True)
    out = subprocess.run(["mutmut", "results", "--all", "true"], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout
    by_function = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and function_of(name) in pure:
            by_function[function_of(name)][status] += 1
    missing = sorted(pure - by_function.keys())
    total = collections.Counter()
    for function in sorted(by_function):
        counts = by_function[function]
        total += counts
        n = sum(counts.values())
        print(f"{function:<55} {counts['killed']:>4}/{n:<4} killed  "
              + "  ".join(f"{s}: {c}" for s, c in sorted(counts.items()) if s != "killed"))
    n = sum(total.values())
    killed = total["killed"] + total["timeout"]
    score = 100.0 * killed / n if n else 0.0
    print(f"\n{killed}/{n} mutants killed over {len(by_function)} functions: {score:.1f} % (the"
          f" {total['timeout']} that time out, an endless loop, counted as killed;"
          f" {100.0 * total['killed'] / n if n else 0:.1f} % without them)")
    if total["not checked"]:
        print(f"{total['not checked']} not checked: the run did not finish", file=sys.stderr)
    if missing:
        print(f"no mutants for: {', '.join(missing)} (renamed or moved? update [tool.shmwatch.mutation])",
              file=sys.stderr)
    return 1 if score < args.min or missing else 0


if __name__ == "__main__":
    sys.exit(main())
