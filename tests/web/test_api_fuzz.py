"""The API fuzzed from its own OpenAPI description (schemathesis): no 5xx, no request that hangs.

Every operation gets a bounded number of generated requests (valid and invalid bodies), sent to the app
served by uvicorn with a 10 s timeout, so that a hang fails the test instead of stalling it.
"""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis (the test extra) is not installed")
from hypothesis import HealthCheck, settings  # noqa: E402


@pytest.fixture(scope="session")
def api_schema(app):  # noqa: ANN001, ANN201
    return schemathesis.openapi.from_dict(app.openapi())


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_error_and_no_hang(case, server) -> None:  # noqa: ANN001
    response = case.call(base_url=server, timeout=10)
    assert response.status_code < 500, f"{case.method} {case.path} {case.body!r:.300} -> {response.status_code}: " \
                                       f"{response.text[:300]}"
    if response.status_code >= 400:
        detail = response.json().get("detail")
        assert isinstance(detail, str) and detail, f"{case.path}: a {response.status_code} without a message"
