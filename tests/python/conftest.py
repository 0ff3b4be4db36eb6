from __future__ import annotations

from pathlib import Path

import pytest
from goldens import GOLDEN
from mlflow_server import MlflowServer


@pytest.fixture
def trained_path() -> Path:
    return GOLDEN / "trained_with_optimizer.ckpt"


_server: list[MlflowServer] = []  # started once collection shows a test will use it


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("mlflow_uri" in getattr(item, "fixturenames", ()) for item in session.items) and not _server:
        _server.append(MlflowServer())


def pytest_sessionfinish(session: pytest.Session) -> None:
    while _server:
        _server.pop().stop()


@pytest.fixture(scope="session")
def mlflow_uri() -> str:
    """The URI of a real MLflow tracking server, up for the session (see mlflow_server.py)."""
    assert _server, "collection starts the server for the tests that use it"
    return _server[0].wait_until_up()
