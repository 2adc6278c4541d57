"""Security: TLS and mTLS on /metrics with certificates made here; nothing under a monitored
mount is ever opened for writing."""
import datetime
import ipaddress
import os
import ssl
import threading
import urllib.error
import urllib.request

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.conftest import Exporter, Peer, fallocate, needs_root, value


def make_cert(name, issuer=None, issuer_key=None, is_ca=False, san_ip=None):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer or subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True))
    if san_ip:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(san_ip))]),
                                        critical=False)
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return cert, key


def write_pem(directory, name, cert, key):
    cert_path, key_path = os.path.join(directory, f"{name}.crt"), os.path.join(directory, f"{name}.key")
    with open(cert_path, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(key_path, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ca, ca_key = make_cert("shmwatch test CA", is_ca=True)
    server, server_key = make_cert("127.0.0.1", ca.subject, ca_key, san_ip="127.0.0.1")
    client, client_key = make_cert("prometheus", ca.subject, ca_key)
    rogue_ca, rogue_key = make_cert("rogue CA", is_ca=True)
    rogue, rogue_client_key = make_cert("intruder", rogue_ca.subject, rogue_key)
    return {"ca": write_pem(d, "ca", ca, ca_key)[0], "server": write_pem(d, "server", server, server_key),
            "client": write_pem(d, "client", client, client_key), "rogue": write_pem(d, "rogue", rogue, rogue_client_key)}


def client_context(pki, cert=None):
    context = ssl.create_default_context(cafile=pki["ca"])
    if cert:
        context.load_cert_chain(*cert)
    return context


@needs_root
def test_tls(tmpfs, pki):
    cert, key = pki["server"]
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.tls-cert-file={cert}",
                  f"--web.tls-key-file={key}", scheme="https", context=client_context(pki)) as exporter:
        text = exporter.scrape_text()
        assert "shmwatch_mount_size_bytes" in text
        with pytest.raises(OSError):  # plain HTTP is refused (URLError and RemoteDisconnected are OSErrors)
            urllib.request.urlopen(exporter.url.replace("https", "http"), timeout=5).read()
        with pytest.raises(urllib.error.URLError):  # a client that does not trust our CA refuses us
            urllib.request.urlopen(exporter.url, timeout=5, context=ssl.create_default_context()).read()


@needs_root
def test_mtls_requires_a_client_certificate(tmpfs, pki):
    cert, key = pki["server"]
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.tls-cert-file={cert}",
                  f"--web.tls-key-file={key}", f"--web.tls-client-ca-file={pki['ca']}", scheme="https",
                  context=client_context(pki, pki["client"])) as exporter:
        assert "shmwatch_build_info" in exporter.scrape_text()
        for context in (client_context(pki), client_context(pki, pki["rogue"])):
            with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError, OSError)):
                urllib.request.urlopen(exporter.url, timeout=5, context=context).read()
        assert exporter.proc.poll() is None  # failed handshakes do not hurt the exporter
        assert "shmwatch_build_info" in exporter.scrape_text()


@needs_root
def test_never_writes_under_a_monitored_mount(tmpfs):
    """An inotify watch on the mount during a full life of the exporter (inventories with
    holders, hidden and orphan segments, events, scrapes): the only modifications seen are
    the test's own."""
    from watchdog.events import FileSystemEventHandler
    from watchdog.observers.inotify import InotifyObserver

    fallocate(os.path.join(tmpfs, "psm_orphan"), 4096)
    seen, lock = [], threading.Lock()

    class Recorder(FileSystemEventHandler):
        def on_any_event(self, event):
            if event.event_type in ("modified", "closed", "created", "deleted", "moved"):
                with lock:
                    seen.append((event.event_type, os.path.basename(event.src_path)))

    observer = InotifyObserver()
    observer.schedule(Recorder(), tmpfs)
    observer.start()
    try:
        with Peer(tmpfs, "hidden", "nccl-h1dd3n", str(1 << 20)), Peer(tmpfs, "mapped", "nccl-m4pped", str(1 << 20)):
            import time
            time.sleep(1)  # inotify delivers the peers' own creates and writes asynchronously
            with lock:
                ours = len(seen)
            with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", "--inventory-interval=200ms") as exporter:
                for _ in range(10):
                    exporter.scrape_text()
                s = exporter.wait_for(lambda s: value(s, "shmwatch_segments", mount=tmpfs, state="hidden",
                                                      **{"class": "nccl"}) == 1, timeout=5)
                assert value(s, "shmwatch_segments", mount=tmpfs, state="orphan", **{"class": "python_shm"}) == 1
                time.sleep(1)
                with lock:
                    during = seen[ours:]
    finally:
        observer.stop()
        observer.join()
    assert during == [], f"the exporter modified the mount: {during}"
