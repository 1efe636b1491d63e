"""Fixtures shared by the test files: `db` runs a test once on each backend (an SQLite file, then a
fresh PostgreSQL database); a PostgreSQL run skips, with the reason, where no server is reachable
(and fails instead when INTERACTIOND_REQUIRE_POSTGRES=1, as in CI)."""
from __future__ import annotations

import pytest

from daemon_kit import BACKENDS, database


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def db(backend, tmp_path):
    with database(backend, tmp_path) as where:
        yield where
