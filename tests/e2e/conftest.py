"""The stack most end-to-end tests share: one LocalStack (every service, with its own NATS, S3, Redis and
database) in the default configuration, started once for the session, since starting one takes about
half a minute here. Each test works in runs of its own, so what it checks is scoped by run id (a count
over a stream every run shares, like the dead letters, is taken as a difference). Tests that configure
the services (cancel, chaos, an external engine) start stacks of their own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from crucible.localstack import LocalStack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with LocalStack(api_port=0, state_dir=tmp_path_factory.mktemp("shared-stack")) as shared:
        yield shared
