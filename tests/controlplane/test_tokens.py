"""TokenStore: hashed registration tokens, node binding, revocation, malformed input."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from iop_trio.controlplane import TokenStore
from iop_trio.controlplane.tokens import PREFIX, split_token


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "tokens" / "edge.db"


@pytest.fixture
def store(db_path: Path) -> Iterator[TokenStore]:
    tokens = TokenStore(db_path)
    try:
        yield tokens
    finally:
        tokens.close()


def _secret(token: str) -> str:
    parts = split_token(token)
    assert parts is not None
    return parts[1]


def _database_bytes(db_path: Path) -> bytes:
    """The main database file plus its WAL/SHM companions, whichever exist."""
    return b"".join(
        path.read_bytes()
        for path in sorted(db_path.parent.iterdir())
        if path.name.startswith(db_path.name)
    )


async def test_created_token_is_accepted_for_any_node(store: TokenStore) -> None:
    issued = store.create()
    assert issued.node_id is None
    assert issued.token.startswith(f"{PREFIX}{issued.token_id}.")
    for node_id in ("node-a", "node-b", "anything"):
        check = await store.check(issued.token, node_id)
        assert check.ok, check
        assert check.token_id == issued.token_id
        assert check.reason == ""


async def test_tokens_are_unique(store: TokenStore) -> None:
    first, second = store.create(), store.create()
    assert first.token_id != second.token_id
    assert first.token != second.token
    assert _secret(first.token) != _secret(second.token)


async def test_bound_token_only_works_for_its_node(store: TokenStore) -> None:
    issued = store.create(node_id="gpu-1")
    assert issued.node_id == "gpu-1"
    assert (await store.check(issued.token, "gpu-1")).ok

    wrong = await store.check(issued.token, "gpu-2")
    assert not wrong.ok
    assert "bound" in wrong.reason
    assert "gpu-1" in wrong.reason
    assert wrong.token_id == issued.token_id


async def test_revoked_token_is_rejected(store: TokenStore) -> None:
    issued = store.create()
    other = store.create()
    assert store.revoke(issued.token_id) is True

    check = await store.check(issued.token, "node")
    assert not check.ok
    assert "revoked" in check.reason
    # Revocation is per token: the other one still works.
    assert (await store.check(other.token, "node")).ok
    # Revoking again changes nothing and says so.
    assert store.revoke(issued.token_id) is False


async def test_revoked_bound_token_reports_revoked(store: TokenStore) -> None:
    issued = store.create(node_id="gpu-1")
    assert store.revoke(issued.token_id)
    check = await store.check(issued.token, "gpu-1")
    assert not check.ok
    assert "revoked" in check.reason


def test_revoke_unknown_id_returns_false(store: TokenStore) -> None:
    assert store.revoke("does-not-exist") is False
    store.create()
    assert store.revoke("does-not-exist") is False


@pytest.mark.parametrize(
    "token", ["", "abc", "iop_x", "iop_.y", "iop_x.", "iop_", "iop_.", "x_abc.def"]
)
async def test_malformed_tokens(store: TokenStore, token: str) -> None:
    store.create()
    check = await store.check(token, "node")
    assert not check.ok
    assert "malformed" in check.reason
    assert check.token_id == ""


async def test_correct_id_with_wrong_secret_is_unknown(store: TokenStore) -> None:
    issued = store.create()
    forged = f"{PREFIX}{issued.token_id}.{_secret(issued.token)}x"
    check = await store.check(forged, "node")
    assert not check.ok
    assert "unknown" in check.reason
    # An unknown token does not reveal which id it tried.
    assert check.token_id == ""

    other = store.create()
    swapped = f"{PREFIX}{issued.token_id}.{_secret(other.token)}"
    assert "unknown" in (await store.check(swapped, "node")).reason


async def test_unknown_id_is_unknown(store: TokenStore) -> None:
    issued = store.create()
    check = await store.check(f"{PREFIX}ffffffffffff.{_secret(issued.token)}", "node")
    assert not check.ok
    assert "unknown" in check.reason


async def test_database_never_contains_the_secret(store: TokenStore, db_path: Path) -> None:
    issued = [store.create(), store.create(node_id="gpu-1")]
    store.revoke(issued[0].token_id)
    await store.check(issued[1].token, "gpu-1")

    def assert_no_secrets() -> None:
        data = _database_bytes(db_path)
        for token in issued:
            secret = _secret(token.token)
            assert secret.encode() not in data
            assert token.token.encode() not in data
            # Sanity check that we are reading the right bytes: the id and the hash are there.
            assert token.token_id.encode() in data
            assert hashlib.sha256(secret.encode()).hexdigest().encode() in data

    assert_no_secrets()
    store.close()
    assert_no_secrets()


def test_list_shows_ids_never_secrets(store: TokenStore) -> None:
    assert store.list() == []
    first = store.create()
    second = store.create(node_id="gpu-1")
    store.revoke(first.token_id)

    rows = store.list()
    assert [row["token_id"] for row in rows] == [first.token_id, second.token_id]
    assert [row["node_id"] for row in rows] == [None, "gpu-1"]
    assert rows[0]["revoked_at"] is not None
    assert rows[1]["revoked_at"] is None
    for row in rows:
        assert "secret_hash" not in row
        for issued in (first, second):
            secret = _secret(issued.token)
            digest = hashlib.sha256(secret.encode()).hexdigest()
            for value in row.values():
                assert secret not in str(value)
                assert digest not in str(value)


async def test_tokens_survive_reopening(db_path: Path) -> None:
    first = TokenStore(db_path)
    try:
        issued = first.create(node_id="gpu-1")
        revoked = first.create()
        first.revoke(revoked.token_id)
    finally:
        first.close()

    second = TokenStore(db_path)
    try:
        assert (await second.check(issued.token, "gpu-1")).ok
        assert "revoked" in (await second.check(revoked.token, "gpu-1")).reason
    finally:
        second.close()
