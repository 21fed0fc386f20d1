"""The audit head's anchor without a database: the key file, the MAC verdict, and the rule
that an append never signs over a head that does not verify."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from gateway.access import audit

KEY = bytes(range(32))


def chain(seq: int, digest: str = "ab" * 32) -> audit.Verdict:
    return audit.Verdict(True, seq, digest)


def test_a_valid_head_mac_verifies() -> None:
    mac = audit.head_mac(KEY, 6, "ab" * 32)
    v = audit.check_anchor(chain(6), head_seq=6, mac=mac, stored_key_id=audit.key_id(KEY), key=KEY)
    assert v.ok and v.anchor == audit.VERIFIED and "intact" in v.message() and audit.key_id(KEY) in v.message()


@pytest.mark.parametrize("case,words", [
    ("moved back", "does not match entry 4"),
    ("re-hashed", "does not match entry 6"),
    ("no mac", "carries no MAC"),
    ("empty, unsigned", "never signed"),
    ("other key", "not with this key file's"),
])
def test_a_rewritten_head_is_broken(case: str, words: str) -> None:
    good = audit.head_mac(KEY, 6, "ab" * 32)
    seq, digest, mac, kid = {
        "moved back": (4, "cd" * 32, good, audit.key_id(KEY)),
        "re-hashed": (6, "ef" * 32, good, audit.key_id(KEY)),
        "no mac": (6, "ab" * 32, None, None),
        "empty, unsigned": (0, audit.GENESIS, None, None),
        "other key": (6, "ab" * 32, audit.head_mac(b"k" * 32, 6, "ab" * 32), audit.key_id(b"k" * 32)),
    }[case]
    v = audit.check_anchor(chain(seq, digest), head_seq=seq, mac=mac, stored_key_id=kid, key=KEY)
    assert not v.ok and v.anchor == audit.BROKEN and words in v.problem, v.problem
    assert v.message().startswith("audit log BROKEN at the head")


def test_without_the_key_nothing_is_claimed() -> None:
    v = audit.check_anchor(chain(6), head_seq=6, mac="00" * 32, stored_key_id="x", key=None,
                           key_problem="no audit key file at /nowhere")
    assert not v.ok and v.anchor == audit.UNCHECKED
    assert "could not be checked" in v.message() and "/nowhere" in v.message() and "intact" not in v.message()


def test_the_key_file_is_made_once_0600_and_read_back(tmp_path: Path) -> None:
    path = tmp_path / "state" / "audit.key"
    with pytest.raises(audit.KeyUnavailable, match="no audit key file"):
        audit.read_key(path)
    results: list[tuple[bytes, bool]] = []
    threads = [threading.Thread(target=lambda: results.append(audit._create_key(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({k for k, _ in results}) == 1 and sum(made for _, made in results) == 1, "one key wins the race"
    key = results[0][0]
    assert len(key) == audit.KEY_BYTES and path.read_bytes() == key
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["audit.key"], "no temp file left behind"
    assert audit.load_key(path) == key
    path.chmod(0o640)
    with pytest.raises(audit.KeyUnavailable, match="readable by others"):
        audit.read_key(path)
    path.chmod(0o600)
    path.write_bytes(b"short")
    with pytest.raises(audit.KeyUnavailable, match="holds 5 bytes"):
        audit.read_key(path)


def test_load_key_never_replaces_an_unusable_key(tmp_path: Path) -> None:
    path = tmp_path / "audit.key"
    path.write_bytes(KEY)
    path.chmod(0o644)
    with pytest.raises(audit.KeyUnavailable, match="readable by others"):
        audit.load_key(path, create=True)
    assert path.read_bytes() == KEY


def test_an_append_signs_only_over_a_head_that_verifies(tmp_path: Path) -> None:
    path = tmp_path / "k"
    good = audit.head_mac(KEY, 5, "ab" * 32)
    assert audit._may_sign(KEY, path, 5, "ab" * 32, good, audit.key_id(KEY))
    assert not audit._may_sign(KEY, path, 4, "cd" * 32, good, audit.key_id(KEY)), "head moved back"
    assert not audit._may_sign(KEY, path, 5, "ab" * 32, good, "0123456789abcdef"), "another key's head"
    assert not audit._may_sign(KEY, path, 5, "ab" * 32, None, None), "unsigned, and the key is not new"
    audit._fresh.add(path)                       # this process just made the key: first use
    assert audit._may_sign(KEY, path, 0, audit.GENESIS, None, None)
    assert audit._may_sign(KEY, path, 5, "ab" * 32, good, audit.key_id(KEY))
    assert path not in audit._fresh, "once a signed head is seen, an unsigned one is never signed again"
    assert not audit._may_sign(KEY, path, 5, "ab" * 32, None, None)
