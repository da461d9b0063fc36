"""Shared fixtures of the serve tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def demo_server(demo_engine):
    """The OpenAI-compatible API over demo_engine, on a free loopback port."""
    from engine.serve.api import ApiServer, create_app

    srv = ApiServer(create_app(demo_engine)).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def demo_client(demo_server):
    """The official openai client of demo_server (no retries: a failure shows at once)."""
    import openai

    return openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="anything", max_retries=0, timeout=120)
