"""Gzip made from blocks compressed once: a body whose blocks mostly did not change since
the last render costs the changed blocks' compression, not the whole body's.

As pigz compresses in parallel: each block is raw deflate from a fresh compressor, ended
with a sync flush (byte-aligned, not final, referring to nothing before it), so the blocks
join into one deflate stream; an empty final block, then the CRC-32 and length of the
whole text, close the gzip member (RFC 1952). A node's 1.8 MB exposition took 11 ms of
gzip per render, while most of its families had not changed since the last one.
"""

from __future__ import annotations

import struct
import zlib
from typing import Dict, List, Tuple

# A family's lines are cut into blocks after each line whose hash has these bits clear:
# about one block per 64 lines (17 KB at a node's 270 bytes a line). The cuts depend on the
# lines alone (content-defined, as rsync's and borg's chunks), so a line added to one pod's
# series changes the block it falls in, not every block after it.
BLOCK_MASK = 63
# deflate; no name, no mtime; XFL (2: best compression, 4: fastest, as gzip.compress says); OS unknown
_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00%c\xff"
_FINAL = b"\x03\x00"  # an empty final block (fixed Huffman codes)


def blocks_of(lines: List[str]) -> List[str]:
    """`lines` joined into blocks, cut where the lines say (see BLOCK_MASK); at least one."""
    out: List[str] = []
    start = 0
    for i, line in enumerate(lines):
        if not hash(line) & BLOCK_MASK:
            out.append("".join(lines[start : i + 1]))
            start = i + 1
    if start < len(lines) or not out:
        out.append("".join(lines[start:]))
    return out


class GzipBlocks:
    """The compressed blocks of the last render, by their text; only what the current
    render used is kept for the next."""

    def __init__(self, level: int):
        self.level = level
        self._header = _HEADER % (2 if level == 9 else 4 if level == 1 else 0)
        self._previous: Dict[str, bytes] = {}
        self._current: Dict[str, bytes] = {}
        # Each family's lines and their blocks, by family name, from the last render and this one.
        self._cut_previous: Dict[str, Tuple[List[str], List[str]]] = {}
        self._cut_current: Dict[str, Tuple[List[str], List[str]]] = {}
        self.compressed = 0  # blocks compressed (tests: an unchanged block is not)

    def next_render(self) -> None:
        self._previous, self._current = self._current, {}
        self._cut_previous, self._cut_current = self._cut_current, {}

    def blocks(self, name: str, lines: List[str]) -> List[str]:
        """blocks_of(lines); the last render's blocks when the family's lines are the same
        (most of a node's families, between two renders). They are then the same string
        objects, whose hashes Python keeps: finding their compressed bytes takes no pass
        over the 2 MB of text, nor does cutting them again."""
        known = self._cut_previous.get(name)
        blocks = (
            known[1] if known is not None and known[0] == lines else blocks_of(lines)
        )
        self._cut_current[name] = (lines, blocks)
        return blocks

    def gzip(self, pieces: List[str], raw: bytes) -> bytes:
        """A gzip member of `raw`, which must be "".join(pieces) in UTF-8."""
        out = [self._header]
        current, previous = self._current, self._previous
        for piece in pieces:
            block = current.get(piece) or previous.get(piece)
            if block is None:
                compressor = zlib.compressobj(
                    self.level, zlib.DEFLATED, -zlib.MAX_WBITS
                )
                block = compressor.compress(piece.encode("utf-8")) + compressor.flush(
                    zlib.Z_SYNC_FLUSH
                )
                self.compressed += 1
            current[piece] = block
            out.append(block)
        out.append(_FINAL)
        out.append(struct.pack("<II", zlib.crc32(raw), len(raw) & 0xFFFFFFFF))
        return b"".join(out)
