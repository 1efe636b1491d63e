"""Fixtures shared by the test files: `db` runs a test once on each backend (an SQLite file, then a
fresh PostgreSQL database); a PostgreSQL run skips, with the reason, where no server is reachable
(and fails instead when INTERACTIOND_REQUIRE_POSTGRES=1, as in CI). `d` is a daemon on that
database and the manual clock; `chat_d` is one whose playbook delivers through the example chat
service. A test file that runs on SQLite only overrides `backend`."""
from __future__ import annotations

import pytest

from daemon_kit import BACKENDS, database, start_chat_daemon, start_daemon


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def db(backend, tmp_path):
    with database(backend, tmp_path) as where:
        yield where


@pytest.fixture
async def d(db, aiohttp_client):
    return await start_daemon(aiohttp_client, db)


@pytest.fixture
async def chat_d(db, tmp_path, aiohttp_client):
    return await start_chat_daemon(aiohttp_client, db, tmp_path / "chat.db")
