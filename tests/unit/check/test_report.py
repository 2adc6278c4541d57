"""check's `rm` advice for leaked files with hard links, word for word (report.shm with the
names names.leaked_names found): every name of a file in one `rm --`, or none and why."""
from types import SimpleNamespace

from exporter.check.findings import Report
from exporter.check.names import Names
from exporter.check.report import diagnose, shm
from exporter.model.step import Model, MountView
from exporter.model.summary import summarise
from exporter.model.types import Inventory
from tests.test_decisions import GiB, MiB, inventory, seg, usage, view

CALM = "once no server can attach to them"


def remedy(names, links):
    """The remedy of the leaked-files finding of /m holding nccl-* orphans `names` (inodes 1, 2,
    ...) given `links`: inode -> Names."""
    inv = inventory("/m", [seg(n, "nccl", "orphan", MiB) for n in names])
    u = usage(GiB, 0, "/m")
    v = MountView("/m", {}, u, None, None, None, inv, summarise(inv, 5), None, view(u).budget)
    report = Report()
    shm(report, v, SimpleNamespace(inventory=Inventory([], {}, 0, 1)), None, {(0, i): n for i, n in links.items()})
    [leaked] = [f for f in report.findings if "leaked" in f.message]
    return leaked.remedy


def test_a_file_with_several_names_is_removed_by_all_of_them():
    links = {1: Names(("nccl-a", "sub/nccl-b", "nccl-c d"), 3), 2: Names(("nccl-z",), 1)}
    assert remedy(["nccl-a", "nccl-z"], links) == (
        f"{CALM} (/m/nccl-a has 3 names, all removed): rm -- /m/nccl-a /m/sub/nccl-b '/m/nccl-c d' /m/nccl-z")


def test_a_file_with_a_name_not_found_or_gone_is_left_out_and_said():
    links = {1: Names(("nccl-a",), 2), 2: Names(("nccl-z",), 1), 3: Names((), 0)}
    assert remedy(["nccl-a", "nccl-z", "nccl-y"], links) == (
        f"{CALM} (/m/nccl-a has 2 names, 1 not found below /m: removing the others frees nothing; "
        "/m/nccl-y is gone or another file since listed): rm -- /m/nccl-z")
    assert remedy(["nccl-a"], {1: Names(("nccl-a", "x/nccl-b"), 3)}) == (
        "/m/nccl-a has 3 names, 1 not found below /m: removing the others frees nothing")  # no rm at all


def test_a_file_also_named_as_another_class_is_not_advised_away():
    assert remedy(["nccl-a", "nccl-\x1b"], {1: Names(("lock", "nccl-a"), 2), 2: Names(("nccl-\x1b",), 1)}) == (
        f"{CALM} (/m/nccl-a is also lock, of no class shmwatch removes): rm -- $'/m/nccl-\\x1b'")


def test_without_the_names_looked_up_each_is_removed_by_its_listed_name():
    assert remedy(["nccl-a", "nccl-$(id)"], {}) == f"{CALM}: rm -- '/m/nccl-$(id)' /m/nccl-a"


def test_diagnose_hands_the_names_looked_up_to_each_mounts_advice():
    # check's main looks the leaked files' names up once (names.leaked_names) and diagnose
    # passes them down to the rm advice of the mount that lists them.
    inv = inventory("/m", [seg("nccl-a", "nccl", "orphan", MiB)])
    u = usage(GiB, 0, "/m")
    v = MountView("/m", {}, u, None, None, None, inv, summarise(inv, 5), None, view(u).budget)
    model = Model(node_mode=False, statuses=[], mounts=[v], inventory=Inventory([], {}, 0, 1), cgroups=[],
                  host_memory=None, sysv=[], gpu=None, process_samples=[], states=None)
    report = diagnose(model, links={(0, 1): Names(found=("nccl-a", "sub/nccl-b"), links=2)})
    [leaked] = [f for f in report.findings if "leaked" in f.message]
    assert leaked.remedy == f"{CALM} (/m/nccl-a has 2 names, all removed): rm -- /m/nccl-a /m/sub/nccl-b"
