"""Pre-issued registration tokens, stored hashed.

A token reads ``iop_<id>.<secret>``. Only a SHA-256 of the secret is stored, so the database
never holds a usable token; the id lets an operator revoke one without knowing it. A token
created ``--node NAME`` only registers a node with that id.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import time
from pathlib import Path
from typing import Any

from attrs import frozen

from ..store import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    token_id    TEXT PRIMARY KEY,
    secret_hash TEXT NOT NULL,
    node_id     TEXT,
    created_at  REAL NOT NULL,
    revoked_at  REAL
);
"""

PREFIX = "iop_"


@frozen
class IssuedToken:
    token_id: str
    token: str
    node_id: str | None


@frozen
class TokenCheck:
    ok: bool
    reason: str = ""
    token_id: str = ""


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def split_token(token: str) -> tuple[str, str] | None:
    if not token.startswith(PREFIX):
        return None
    token_id, dot, secret = token[len(PREFIX) :].partition(".")
    if not dot or not token_id or not secret:
        return None
    return token_id, secret


class TokenStore:
    def __init__(self, path: str | Path, *, in_thread: bool = True) -> None:
        self.db = Database(path, SCHEMA, in_thread=in_thread)

    def create(self, node_id: str | None = None) -> IssuedToken:
        token_id = secrets.token_hex(6)
        secret = secrets.token_urlsafe(24)
        self.db.call_sync(
            lambda conn: conn.execute(
                "INSERT INTO tokens (token_id, secret_hash, node_id, created_at) VALUES (?, ?, ?, ?)",
                (token_id, _hash(secret), node_id, time.time()),
            )
        )
        return IssuedToken(token_id, f"{PREFIX}{token_id}.{secret}", node_id)

    def revoke(self, token_id: str) -> bool:
        def update(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE tokens SET revoked_at=? WHERE token_id=? AND revoked_at IS NULL",
                (time.time(), token_id),
            )
            return cursor.rowcount == 1

        return self.db.call_sync(update)

    def list(self) -> list[dict[str, Any]]:
        rows = self.db.call_sync(
            lambda conn: conn.execute(
                "SELECT token_id, node_id, created_at, revoked_at FROM tokens ORDER BY created_at"
            ).fetchall()
        )
        return [dict(row) for row in rows]

    async def check(self, token: str, node_id: str) -> TokenCheck:
        """Is ``token`` valid, unrevoked and allowed for ``node_id``? Read at every registration,
        so a token created or revoked while the edge runs takes effect at once."""
        parts = split_token(token)
        if parts is None:
            return TokenCheck(False, "malformed token")
        token_id, secret = parts
        row = await self.db.call(
            lambda conn: conn.execute(
                "SELECT secret_hash, node_id, revoked_at FROM tokens WHERE token_id=?", (token_id,)
            ).fetchone()
        )
        if row is None or not hmac.compare_digest(row["secret_hash"], _hash(secret)):
            return TokenCheck(False, "unknown token")
        if row["revoked_at"] is not None:
            return TokenCheck(False, "token revoked", token_id)
        if row["node_id"] and row["node_id"] != node_id:
            return TokenCheck(False, f"token is bound to node {row['node_id']!r}", token_id)
        return TokenCheck(True, token_id=token_id)

    def close(self) -> None:
        self.db.close()
