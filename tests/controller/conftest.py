"""Stores for the controller tests: SQLite in a temporary directory and PostgreSQL.

PostgreSQL runs on 127.0.0.1:5432 (trust auth, database ``test``). Each test gets its
own login role and a schema of the same name (PostgreSQL's default search path
``"$user"`` puts it first), so parallel runs never collide; both are dropped afterwards.
With ``SPECPILOT_REQUIRE_POSTGRES=1`` an unreachable PostgreSQL fails the tests;
without it they are skipped.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from tests.conftest import required

PG_HOST, PG_PORT, PG_DB = "127.0.0.1", 5432, "test"


def _admin_connection() -> psycopg.Connection[tuple[object, ...]]:
    errors = []
    for user in ("postgres", "root"):
        try:
            return psycopg.connect(
                host=PG_HOST,
                port=PG_PORT,
                dbname=PG_DB,
                user=user,
                autocommit=True,
                connect_timeout=3,
            )
        except psycopg.OperationalError as exc:
            errors.append(f"{user}: {exc}")
    message = "PostgreSQL on 127.0.0.1:5432 is not reachable: " + "; ".join(errors)
    if required("POSTGRES"):
        pytest.fail(message)
    pytest.skip(message)


@dataclass
class PgDatabase:
    """A private role + schema on the test PostgreSQL, and an admin connection to break it."""

    role: str
    admin: psycopg.Connection[tuple[object, ...]]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://{self.role}@{PG_HOST}:{PG_PORT}/{PG_DB}"

    def terminate_backends(self) -> int:
        rows = self.admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
            (self.role,),
        ).fetchall()
        return len(rows)

    def refuse_logins(self) -> None:
        """Make the database unreachable for this role: no new sessions, current ones killed."""
        self.admin.execute(f'ALTER ROLE "{self.role}" NOLOGIN')
        self.terminate_backends()

    def allow_logins(self) -> None:
        self.admin.execute(f'ALTER ROLE "{self.role}" LOGIN')


@pytest.fixture
def pg() -> Iterator[PgDatabase]:
    admin = _admin_connection()
    role = f"sp_{uuid.uuid4().hex[:16]}"
    admin.execute(f'CREATE ROLE "{role}" LOGIN')
    admin.execute(f'CREATE SCHEMA "{role}" AUTHORIZATION "{role}"')
    database = PgDatabase(role, admin)
    try:
        yield database
    finally:
        database.terminate_backends()
        admin.execute(f'DROP SCHEMA "{role}" CASCADE')
        admin.execute(f'DROP ROLE "{role}"')
        admin.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'data' / 'specpilot.db'}"
    database: PgDatabase = request.getfixturevalue("pg")
    return database.url
