"""Property-based fuzzing of the live OpenAPI schema (real uvicorn on loopback, both databases):
at least 1000 generated requests, valid and invalid, and no 5xx answer to any of them; valid ones
also get a documented status and a body matching its schema."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings, strategies
from schemathesis import Case, CheckFunction, GenerationMode
from schemathesis.checks import (
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import CLIENT_TOKEN, WORKER_TOKEN, LiveServer

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
CASES = 1000


def test_no_server_errors_on_generated_requests(live_server: LiveServer) -> None:
    schema = schemathesis.openapi.from_url(f"{live_server.url}/openapi.json")
    # Valid requests must also get documented statuses and bodies that match their schemas.
    cases = strategies.one_of(
        schema.as_strategy(GenerationMode.POSITIVE).map(lambda case: (case, True)),
        schema.as_strategy(GenerationMode.NEGATIVE).map(lambda case: (case, False)),
    )
    seen: list[str] = []
    session = requests.Session()

    @given(case_and_validity=cases)
    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case_and_validity: tuple[Case[Any], bool]) -> None:
        case, valid = case_and_validity
        token = WORKER_TOKEN if "/worker/" in case.path else CLIENT_TOKEN
        response = case.call(
            base_url=live_server.url,
            session=session,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30,
        )
        seen.append(f"{case.method} {case.path} {response.status_code}")
        checks: list[CheckFunction] = [not_a_server_error]
        if valid:
            checks += [status_code_conformance, response_schema_conformance]
        case.validate_response(response, checks=checks)

    check()
    session.close()
    statuses = Counter(line.rsplit(" ", 1)[1] for line in seen)
    print(f"{len(seen)} cases, statuses: {dict(sorted(statuses.items()))}")
    # The fuzzer must reach the handlers, not only bounce off validation.
    assert statuses["200"] + statuses["202"] + statuses["204"] >= 50
    assert len(seen) >= CASES
    operations = {" ".join(line.split()[:2]) for line in seen}
    assert len(operations) == len(list(schema.get_all_operations()))
