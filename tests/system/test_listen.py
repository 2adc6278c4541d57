"""--web.listen-address as node_exporter reads it: ':PORT' and '[::]:PORT' are dual-stack,
'127.0.0.1:PORT' and '0.0.0.0:PORT' IPv4 only, '[::1]:PORT' IPv6 only."""
import socket
import urllib.request

import pytest

from tests.conftest import Exporter, needs_root, prerequisite_missing


def ipv6_loopback():
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def answers(url):
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return response.status == 200 and b"shmwatch_build_info" in response.read()
    except OSError:
        return False


@pytest.fixture(autouse=True)
def needs_ipv6():
    if not ipv6_loopback():
        prerequisite_missing("no IPv6 loopback on this machine (::1): dual-stack cannot be tested")


@needs_root
@pytest.mark.parametrize("listen,v4,v6", [
    ("", True, True),           # the default ':9841'
    ("[::]", True, True),
    ("0.0.0.0", True, False),
    ("127.0.0.1", True, False),
    ("[::1]", False, True),
])
def test_listen_address_forms(tmpfs, listen, v4, v6):
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", listen=listen) as exporter:
        port = exporter.port
        assert answers(f"http://127.0.0.1:{port}/metrics") == v4
        assert answers(f"http://[::1]:{port}/metrics") == v6
        assert "listening on http://" in exporter.log()
