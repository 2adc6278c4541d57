"""classes.py: who made a segment, by its basename, as each library names its files; the
first row that matches wins; the class sets the advice and the alerts rely on."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exporter.model.classes import CLASS_NAMES, CLASSES, NOT_LEAKS, REMOVABLE, classify

# Names as the libraries make them (the table's `source` column), and their class.
REAL_NAMES = [
    ("nccl-AbC123", "nccl"),
    ("nccl-shm-recv-f00d", "nccl"),  # NCCL <= 2.11
    ("vader_segment.gpu-node-7.3a0e0001.2", "mpi"),
    ("sm_segment.gpu-node-7.1000.7b2c0001.0", "mpi"),
    ("mpich_shar_tmpXyZ12", "mpi"),
    ("shm-col-space-4242-1", "mpi"),
    ("psm_shm.0a1b2c3d", "mpi"),  # PSM's, not a multiprocessing psm_*
    ("psm2_shm.0a1b2c3d-1", "mpi"),
    ("ucx_shm_posix_3f2e1d0c", "ucx"),
    ("torch_4242_1887916540_0", "torch"),
    ("psm_5a1f0b2c", "python_shm"),
    ("sgl_shm_mm_4242_ab12", "sglang"),
    ("sglang_loads_0", "sglang"),
    ("sem.loky-4242-abcdef", "semaphore"),
    ("sem.mp-7f3a2b", "semaphore"),
    ("vllm_offload_0b9c2a4e-51f1-4f5e-9a0e-2d7c2f1e9b11.mmap", "vllm_offload"),
    ("plasma_store_socket", "ray"),
    ("nixl_agent_0", "nixl"),
    ("nvidia_dali_4242", "dali"),
    ("triton_python_backend_shm_region_1", "triton"),
    ("cuda.shm.4242.0", "cuda"),
]


@pytest.mark.parametrize("name,cls", REAL_NAMES, ids=[n for n, _ in REAL_NAMES])
def test_each_librarys_names_are_its_class(name, cls):
    assert classify(name) == cls
    assert classify(f"{name} (deleted)") == cls  # as /proc/<pid>/maps names an unlinked one


NEAR_MISSES = [
    "xnccl-1",  # a pattern matches the whole name, not a part
    "nccl",  # no separator: not NCCL's
    "NCCL-1",  # names are case-sensitive
    "torch-1",
    "sem",
    "cuda.shm",
    "psm",
    "containerd-lock",
    "",
]


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_a_name_no_row_matches_whole_is_other(name):
    assert classify(name) == "other"


def test_the_first_matching_row_wins():
    # psm_shm.* (MPI's PSM) and psm_* (multiprocessing) both match psm_shm.x: the MPI row is
    # first; sem.loky-* before the general sem.*, both semaphores.
    rows = [rule.cls for rule in CLASSES if re.fullmatch(rule.pattern, "psm_shm.x")]
    assert rows == ["mpi", "python_shm"] and classify("psm_shm.x") == "mpi"
    assert classify("psm2_shm.x") == "mpi" and classify("psm_x") == "python_shm"


def test_a_newline_or_other_control_in_a_name_is_still_matched():
    # A tmpfs name may hold any byte but NUL and '/': `.*` must cross a newline.
    assert classify("nccl-a\nb") == "nccl"
    assert classify("torch_1\r\x85_2") == "torch"
    assert classify("nccl-x (deleted) (deleted)") == "nccl"  # only the last suffix is maps'


def test_class_names_are_the_tables_in_order_then_other():
    first_seen = list(dict.fromkeys(rule.cls for rule in CLASSES))
    assert list(CLASS_NAMES) == first_seen + ["other"]
    assert len(set(CLASS_NAMES)) == len(CLASS_NAMES)


def test_every_row_compiles_and_says_where_its_names_come_from():
    for rule in CLASSES:
        re.compile(rule.pattern)
        assert rule.source.strip() and rule.cls in CLASS_NAMES


def test_the_advice_sets_are_classes_and_never_other():
    assert REMOVABLE <= set(CLASS_NAMES) and NOT_LEAKS <= set(CLASS_NAMES)
    assert not REMOVABLE & NOT_LEAKS  # a semaphore is neither leaked nor to be removed
    assert "other" not in REMOVABLE  # a name we do not know is never advised for rm
    assert "semaphore" in NOT_LEAKS and "nccl" in REMOVABLE


def test_class_cache_remembers_and_is_bounded():
    from exporter.model.classes import classify
    classify.cache_clear()
    assert classify("nccl-remember") == "nccl"
    assert classify("nccl-remember") == "nccl"  # names repeat between inventories
    assert classify.cache_info().hits == 1  # read from the cache, not re-matched
    classify.cache_clear()
    bound = classify.cache_info().maxsize
    assert bound
    for n in range(bound + 1):
        classify(f"psm_{n:08x}")
        assert classify.cache_info().currsize <= bound
    classify.cache_clear()


@given(st.text(max_size=40))
def test_classify_is_total_and_ignores_deleted(name):
    cls = classify(name)
    assert cls in CLASS_NAMES
    assert classify(name + " (deleted)") == cls


# One example name per row; a longer prefix of an earlier row may win (psm_shm. -> mpi).
ROW_PREFIX = [(r.cls, re.sub(r"(\\\.)?\.\*$", "", r.pattern).replace("\\.", "."), r.pattern) for r in CLASSES]


@pytest.mark.parametrize("cls,prefix,pattern", ROW_PREFIX, ids=[p for _, p, _ in ROW_PREFIX])
@given(suffix=st.text(max_size=20))
def test_every_row_classifies_its_names(cls, prefix, pattern, suffix):
    name = prefix + ("." if pattern.endswith("\\..*") else "") + suffix
    first = next(r.cls for r in CLASSES if re.fullmatch(r.pattern, name, re.S))
    assert classify(name) == first
    assert first == cls or cls == "python_shm"  # only psm_* has more specific rows before it


def test_the_metric_and_class_tables_are_rows_of_code():
    """The catalogue and the segment class table are tuples of frozen rows built by keyword
    (no text read by a regex, which would skip a line it does not match). (The flags are
    code too: exporter/config.py's Config, tests/unit/test_config.py.)"""
    import dataclasses
    import re

    from exporter.model import catalogue, classes

    for rows, kind in ((catalogue.CATALOGUE, catalogue.Metric), (classes.CLASSES, classes.ClassRule)):
        assert rows and all(type(row) is kind for row in rows)
        assert kind.__dataclass_params__.frozen and dataclasses.fields(kind)
    for row in classes.CLASSES:
        re.compile(row.pattern)
        assert re.fullmatch(r"\w+", row.cls) and row.source, row
