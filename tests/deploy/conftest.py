"""The `stack` fixture: one deploy/stack.sh stack per test module, the schedules of deploy/prefect.yaml paused (a test
runs only what it starts), stopped and removed after the module."""

import pytest

from tests.deploy.stack import Stack, pause_yaml_schedules, prefect


@pytest.fixture(scope="module")
def stack():
    s = Stack()
    try:
        s.sh("start")
        prefect(s, lambda client: pause_yaml_schedules(client))
        yield s
    finally:
        s.close()
