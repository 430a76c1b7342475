"""Fixtures shared by the proxy tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxy_fakes import Servers


@pytest.fixture
def serve() -> Iterator[Servers]:
    """Starts apps (``serve(app)``) on loopback; stops them at teardown."""
    servers = Servers()
    yield servers
    servers.close()
