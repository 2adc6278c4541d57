"""render.py's content negotiation: gzip by Accept-Encoding's weights."""

import pytest

from exporter.exposition.render import gzip_wanted


@pytest.mark.parametrize("header,wanted", [
    ("gzip", True), ("gzip, deflate, br", True), ("GZIP", True), ("gzip;q=0.5", True), ("gzip;q=1.000", True),
    ("*", True), ("gzip, identity", True), ("gzip;q=0, gzip", True),
    (None, False), ("", False), ("deflate", False), ("x-gzip", False),
    ("gzip;q=0", False), ("gzip; q=0.000", False), ("gzip;Q=0", False), ("*;q=0", False),
    ("identity, gzip;q=0", False), ("gzip;q=0, *", False),  # gzip named at 0: the * does not count
    ("gzip;q=0.5, identity", False),  # identity preferred
    ("gzip;q=abc", False), ("gzip;q=1.1", False), ("gzip;q=0.0001", False),  # weights that do not parse
])
def test_gzip_is_served_by_accept_encodings_weights(header, wanted):
    assert gzip_wanted(header) is wanted
