"""Schemathesis hooks of the api's fuzz test (test_api_schema_fuzz.py), loaded through SCHEMATHESIS_HOOKS."""

from __future__ import annotations

import schemathesis

OUTSIDE_THE_SCHEMA = [["body", "config", "parallel"]]
"""Where a schema-valid run config may still be refused: JSON Schema cannot state a product."""


@schemathesis.check
def run_config_refusals_name_a_rule_outside_the_schema(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> None:
    """POST /v1/runs refuses a body its schema allows only for the parallel layout's arithmetic (or a
    config the catalog or a sandbox cannot serve): any other 422 of such a body is a rule the schema
    should state."""
    meta = case.meta
    if case.operation.label != "POST /v1/runs" or response.status_code != 422:
        return
    if meta is None or not meta.generation.mode.is_positive:
        return
    for error in response.json()["detail"]:
        if error["type"] != "unservable" and error["loc"] not in OUTSIDE_THE_SCHEMA:
            raise AssertionError(f"a run config its schema allows was refused: {error}")
