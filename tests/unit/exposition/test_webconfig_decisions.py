"""Tests of exporter/exposition/webconfig_decisions.py."""

import base64

import bcrypt

from exporter.exposition.webconfig import WebConfig, WebConfigSource


# --- web-config authorisation -----------------------------------------------------------------
def basic(user, password):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


PEERS = iter(range(1 << 30))


class Source(WebConfigSource):
    """authorize(), waited on when bcrypt runs, from a peer of its own each time."""

    def authorized(self, config, header):
        answer = self.authorize(config, header, f"peer{next(PEERS)}")
        return answer if isinstance(answer, bool) else answer.result(30)


def test_an_unknown_user_is_refused_whatever_the_password():
    """Unknown users are checked against a dummy hash (cost 10, as exporter-toolkit's), whose
    password is 'no such user': a match there must still be a refusal."""
    alice = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4))
    source = Source(fixed=WebConfig(users={"alice": alice}))
    config = source.config
    assert not source.authorized(config, basic("mallory", "no such user"))
    assert not source.authorized(config, basic("mallory", "wonderland"))
    assert not source.authorized(config, basic("alice", "no such user"))
    assert source.authorized(config, basic("alice", "wonderland"))
    assert source.authorized(config, "bAsIc " + basic("alice", "wonderland")[6:])  # the scheme is any case
    for header in (None, "", "Bearer x", "Basic !!", "Basic " + base64.b64encode(b"alice").decode(),
                   "Basic " + base64.b64encode(b"\xff:x").decode()):
        assert not source.authorized(config, header), header
    assert Source(fixed=WebConfig()).authorized(WebConfig(), None)  # no users: open


def test_authorisation_edges():
    users = {"alice": bcrypt.hashpw(b"won:der", bcrypt.gensalt(4))}
    source = Source(fixed=WebConfig(users=users))
    config = source.config
    assert source.authorized(config, basic("alice", "won:der"))  # the password may hold a colon
    mangled = basic("alice", "won:der")
    assert not source.authorized(config, mangled[:10] + "!" + mangled[10:])  # not strictly base64


def test_bcrypt_checks_are_bounded_and_remembered():
    import time
    cheap, dear = bcrypt.hashpw(b"a", bcrypt.gensalt(4)), bcrypt.hashpw(b"b", bcrypt.gensalt(5))
    source = Source(fixed=WebConfig(users={"cheap": cheap, "dear": dear}))
    config = source.config
    assert source.authorized(config, basic("cheap", "a"))  # its own hash only, not padded to 5
    assert source.authorized(config, basic("dear", "b"))
    deadline = time.monotonic() + 20
    while source._checking and time.monotonic() < deadline:  # each check leaves the queue when done
        time.sleep(0.01)
    assert source._checking == set()
    # One check at a time per address, and at most BCRYPT_QUEUE waiting: beyond, refused at once.
    from exporter.exposition.webconfig import BCRYPT_QUEUE
    source._checking.add("10.0.0.9")
    assert source.authorize(config, basic("cheap", "wrong"), "10.0.0.9") is None  # busy: 503
    source._checking.update(f"10.0.1.{i}" for i in range(BCRYPT_QUEUE - 1))
    assert source.authorize(config, basic("cheap", "wrong"), "10.0.2.1") is None
    source._checking.clear()
    # Successes are remembered, within a bound.
    source._good = {bytes([i % 256, i // 256]): None for i in range(1024)}
    fresh = Source(fixed=WebConfig(users={"cheap": cheap}))
    fresh._good = dict(source._good)
    assert fresh.authorized(fresh.config, basic("cheap", "a")) and len(fresh._good) == 1
    assert fresh.authorize(fresh.config, basic("cheap", "a"), "any") is True  # from memory, no bcrypt
