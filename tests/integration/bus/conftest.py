import pytest

from crucible.localstack.servers import start_nats


@pytest.fixture
def nats_url(tmp_path):
    server = start_nats(state_dir=tmp_path)
    yield server.url
    server.stop()
