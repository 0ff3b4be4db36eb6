from __future__ import annotations

import functools
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

# The suite's helper modules (servers, golden files, workers) live in helpers/ and are imported by their
# plain names (``import s3_server``) from every test folder: tests/conftest.py, imported first, puts the
# folder on sys.path.
HELPERS = Path(__file__).resolve().parent / "helpers"

from goldens import GOLDEN  # noqa: E402
from mlflow_server import MlflowServer  # noqa: E402
from s3_server import BUCKET, S3Server  # noqa: E402


@pytest.fixture
def trained_path() -> Path:
    return GOLDEN / "trained_with_optimizer.ckpt"


@pytest.fixture
def compared(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes compared by each sharing save of a manager's steps (the core's own count), in order."""
    from ortckpt import _boundary

    counts: list[int] = []
    real = _boundary.save_sharing

    def counting(*args, **kwargs):
        found = real(*args, **kwargs)
        counts.append(found.compared)
        return found

    monkeypatch.setattr(_boundary, "save_sharing", counting)
    return counts


# `make test` spreads the tests that run on one interpreter only over its interpreters' lanes, by part
# folder, so that the lanes end together: each lane names its parts in ORTCKPT_TEST_PARTS (the
# Makefile's TEST_PARTS_n) and runs their tests (the `once` runs among them) and the every_python tests
# of every part. Unset, every selected test runs.
PARTS = HELPERS.parent


@functools.cache
def lane_parts() -> frozenset[str] | None:
    named = os.environ.get("ORTCKPT_TEST_PARTS")
    if named is None:
        return None
    parts = set(named.split())
    folders = {path.name for path in PARTS.iterdir() if path.is_dir() and path != HELPERS}
    if not parts <= folders:
        raise pytest.UsageError(f"ORTCKPT_TEST_PARTS names no part folder of {PARTS}: {sorted(parts - folders)}")
    return frozenset(parts)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A lane does not import the test files of another lane's parts that hold no every_python test
    (a mark is spelled in its file: @pytest.mark.every_python or pytestmark): they would give it
    nothing, and importing them is most of what collection costs."""
    parts = lane_parts()
    path = Path(collection_path)
    if parts is None or not (path.name.startswith("test_") and path.suffix == ".py") or not path.is_relative_to(PARTS):
        return None
    if path.relative_to(PARTS).parts[0] in parts or "every_python" in path.read_text():
        return None
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    parts = lane_parts()
    if parts is None:
        return
    kept, dropped = [], []
    for item in items:
        path = Path(item.path)
        part = path.relative_to(PARTS).parts[0] if path.is_relative_to(PARTS) else None
        everywhere = item.get_closest_marker("every_python") is not None and item.get_closest_marker("once") is None
        ours = part is None or part in parts or everywhere
        (kept if ours else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


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


_s3: list[S3Server] = []  # started by the first test that uses it (about a second)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS) for the session (see s3_server.py)."""
    _s3.append(S3Server())
    yield _s3[0]
    while _s3:
        _s3.pop().stop(keep_data=False)


@pytest.fixture
def s3_url(s3_server: S3Server, request: pytest.FixtureRequest) -> str:
    """A prefix of its bucket no other test uses: s3://ckpt/<test>-<random>."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"s3://{BUCKET}/{name}-{secrets.token_hex(4)}"


@pytest.fixture
def aws_environment(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test server configured as boto3's users do, by the AWS_* variables alone (any of the
    machine's own AWS_* variables removed for the test)."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    options = s3_server.storage_options()
    monkeypatch.setenv("AWS_ENDPOINT_URL", options["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret_access_key"])
