"""The README is the front door: its tables, commands and file references stay true."""
import importlib.util
import os
import re
import tomllib

from tests.conftest import REPO

GENERATOR = os.path.join(REPO, "docs", "generate.py")
REGENERATE = "run: python3 docs/generate.py README.md"


def _generator():
    """docs/generate.py, loaded by path: it is a script beside the package, not part of it."""
    spec = importlib.util.spec_from_file_location("docs_generate", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = _generator()


def readme():
    with open(os.path.join(REPO, "README.md")) as f:
        return f.read()


def block(text, name):
    return re.search(rf"<!-- {name}:begin -->\n(.*?)\n<!-- {name}:end -->", text, re.S).group(1)


def test_flags_table_is_current():
    assert block(readme(), "flags") == generate.flags_table(), REGENERATE


def test_metrics_table_is_current():
    assert block(readme(), "metrics") == generate.metrics_table(), REGENERATE


def test_classes_table_is_current():
    with open(os.path.join(REPO, "docs", "check.md")) as f:
        assert block(f.read(), "classes") == generate.classes_table(), REGENERATE


def test_every_cli_flag_is_documented():
    from exporter.config import build_parser
    documented = block(readme(), "flags")
    for action in build_parser()._actions:
        for option in action.option_strings:
            if option in ("-h", "--help", "--version"):
                continue
            assert f"`{option}`" in documented, f"{option} missing from the README flags table"


def test_ci_runs_the_readme_test_command():
    command = re.search(r"## Test\n\n```sh\n(.*?)\n```", readme(), re.S).group(1).strip()
    with open(os.path.join(REPO, ".ci", "run")) as f:
        lines = [line.strip() for line in f if line.strip() and not line.startswith("#")]
    assert lines[-1] == command


def test_the_readme_is_at_most_300_lines():
    # For users: development notes live in CONTRIBUTING.md, measurements in docs/performance.md.
    assert len(readme().splitlines()) <= 300


DOCUMENTS = ["README.md", "CONTRIBUTING.md", "CHANGELOG.md", "docs/architecture.md", "docs/performance.md",
             "docs/check.md", "docs/web-config.md"]


def test_files_named_in_the_documents_exist():
    for document in DOCUMENTS:
        with open(os.path.join(REPO, document)) as f:
            text = f.read()
        named = re.findall(r"`((?:exporter|tests|bench|deploy|grafana|docs|\.ci)/[\w./-]+)`", text)
        named += re.findall(r"`([A-Z]+\.md)`", text)
        for path in named:
            assert os.path.exists(os.path.join(REPO, path.rstrip("/"))), f"{document} names {path}"


def test_the_documents_name_no_deleted_machinery():
    # Render on demand: nothing is learned from scrapers, no render thread, no duty cycles.
    for document in DOCUMENTS:
        with open(os.path.join(REPO, document)) as f:
            text = f.read().lower()
        for gone in ("scrape_clock", "scrape clock", "duty cycle", "duty_cycle", "gzip_blocks", "interim run"):
            assert gone not in text, f"{document} describes {gone!r}"


def test_performance_has_one_dated_table_per_release():
    """The latest figures per version, not a diary: one section and one table a version."""
    with open(os.path.join(REPO, "docs", "performance.md")) as f:
        text = f.read()
    releases = re.split(r"^## ", text, flags=re.M)[1:]
    assert releases, "docs/performance.md: no release sections"
    versions = [release.split(" — ")[0] for release in releases]
    assert len(versions) == len(set(versions)), f"docs/performance.md: a version in more than one section: {versions}"
    for release in releases:
        tables = [line for line in release.splitlines() if line.startswith("| figure")]
        assert len(tables) == 1, f"{release.splitlines()[0]}: {len(tables)} tables, not one"
        heading = release.splitlines()[0]
        assert re.fullmatch(r"(\d+\.\d+\.\d+|Unreleased) — \d{4}-\d{2}-\d{2}", heading), \
            f"not '<version or Unreleased> — <date>': {heading}"
        header = next(line for line in release.splitlines() if line.startswith("| figure"))
        for column in ("command", "machine", "peer"):
            assert f"| {column} |" in header + " |", f"{heading}: no {column} column"


def test_one_version_everywhere():
    """pyproject.toml holds the version (exporter/__init__.py reads it); the newest release in
    CHANGELOG.md is it, the work since is "Unreleased" there and in docs/performance.md, and
    what names a version for users (check's JSON example, the image tag to build) names it."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        version = tomllib.load(f)["project"]["version"]

    def text(path):
        with open(os.path.join(REPO, path)) as f:
            return f.read()

    releases = re.findall(r"^## (\S+) — \d{4}-\d{2}-\d{2}$", text("CHANGELOG.md"), re.M)
    assert releases and releases[0] == version, f"CHANGELOG.md's newest release {releases[:1]}, pyproject {version}"
    measured = set(re.findall(r"^## (\S+) — ", text("docs/performance.md"), re.M))
    assert measured <= {"Unreleased", *releases}, f"docs/performance.md names versions never released: {measured}"
    assert re.findall(r'"shmwatch_version": "([^"]+)"', text("docs/check.md")) == [version]
    for shape in ("sidecar", "daemonset"):
        tags = re.findall(r"newTag: (\S+)", text(f"deploy/kubernetes/{shape}/kustomization.yaml"))
        assert tags == [version], f"deploy/kubernetes/{shape}/kustomization.yaml builds shmwatch:{tags}, not {version}"


# Where users read what a series means; each mention of an opt-in family must say it is one.
SIGNAL_DOCS = ["README.md", "docs/architecture.md", "docs/check.md", "deploy/prometheus/runbook.md"]


def _passages(path):
    """A file's units a reader takes in at once: a table row, a prose paragraph, a comment block
    of a manifest, a dashboard panel's description."""
    with open(os.path.join(REPO, path)) as f:
        text = f.read()
    if path.endswith(".json"):
        return re.findall(r'"description": "((?:[^"\\]|\\.)*)"', text)
    if path.endswith((".yaml", ".yml")):
        return re.findall(r"(?:^[ \t]*#.*\n)+", text, re.M)
    rows = [line for line in text.splitlines() if line.startswith("|")]
    prose = [p for p in re.split(r"\n\s*\n", text) if not p.lstrip().startswith("|")]
    return rows + prose


def _manifests():
    found = []
    for root, _, files in os.walk(os.path.join(REPO, "deploy")):
        found += [os.path.relpath(os.path.join(root, f), REPO) for f in files if f.endswith((".yaml", ".yml"))]
    return sorted(found)


def test_every_mention_of_an_opt_in_family_says_it_is_opt_in():
    """An opt-in family is absent by default: a doc that names one as a signal without saying
    so sends the reader after a series that is not there (an absent swap limit read as 'may
    swap', an absent owners_verified as 'not verified')."""
    from exporter.model.catalogue import CATALOGUE
    opt_in = [m.name for m in CATALOGUE if not m.default]
    unsaid = []
    for path in SIGNAL_DOCS + _manifests() + ["grafana/shmwatch.json"]:
        for passage in _passages(path):
            named = [n for n in opt_in if re.search(rf"\b{n}\b", passage)]
            if named and "opt-in" not in passage:
                unsaid.append(f"{path}: {named}: {passage.strip()[:100]}")
    assert not unsaid, "\n".join(unsaid)
