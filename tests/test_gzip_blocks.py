"""Gzip from blocks compressed once (exporter/exposition/gzip_blocks.py): what any gzip reader gets is
the body, and a render compresses only the blocks that changed since the last one."""
import gzip
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.exposition.gzip_blocks import GzipBlocks, blocks_of

lines = st.lists(st.text(max_size=40).map(lambda t: t.replace("\n", "") + "\n"), max_size=300)


@settings(max_examples=200, deadline=None)
@given(st.lists(lines, max_size=6), st.integers(1, 9))
def test_the_blocks_make_one_gzip_member_of_the_whole_body(families, level):
    pieces = [block for family in families for block in blocks_of(family)] + [""]
    raw = "".join(pieces).encode("utf-8")
    body = GzipBlocks(level).gzip(pieces, raw)
    assert gzip.decompress(body) == raw
    reader = zlib.decompressobj(wbits=31)  # one member, read to its end: nothing after it
    assert reader.decompress(body) == raw and reader.eof and not reader.unused_data


def test_a_render_compresses_only_the_blocks_that_changed():
    family = [f'm{{mount="/pods/{i}/dshm"}} {i}\n' for i in range(5000)]
    blocks = GzipBlocks(1)
    first = blocks_of(family)
    assert len(first) > 20  # cut at the lines, about every 64
    blocks.gzip(first, "".join(first).encode())
    compressed = blocks.compressed
    blocks.next_render()
    family.insert(2500, 'm{mount="/pods/new/dshm"} 1\n')  # a pod's series added in the middle
    second = blocks_of(family)
    body = blocks.gzip(second, "".join(second).encode())
    assert gzip.decompress(body) == "".join(family).encode()
    assert blocks.compressed - compressed <= 2, "the cuts moved: blocks after the new line were compressed again"


@given(st.integers(1, 9))
def test_the_header_says_the_level_as_gzip_compress_does(level):
    """XFL (RFC 1952: 2 for the best compression, 4 for the fastest) as Python's gzip writes it."""
    header = GzipBlocks(level).gzip(["x\n"], b"x\n")[:10]
    assert header[8] == gzip.compress(b"x\n", level)[8]
    assert header[:4] == b"\x1f\x8b\x08\x00" and header[4:8] == b"\x00\x00\x00\x00"  # no flags, no mtime
