"""Schemathesis hooks for scripts/api_schema_check.py (loaded through SCHEMATHESIS_HOOKS).

schemathesis 3.39 can generate an "invalid" request whose only invalid part is an undeclared
query parameter holding an empty list (or None, or an empty object): serialized, it is not
sent at all, so the request on the wire is a valid one, and a 200 answer is then reported as
"accepted negative data" although the API saw nothing invalid. Such cases are dropped before
they are sent; every other invalid request is kept and must still be refused.
"""

from __future__ import annotations

from typing import Any

import jsonschema
import schemathesis


def _vanishes(value: Any) -> bool:
    """Whether a query value is left out of the URL when serialized."""
    return value is None or value == [] or value == {}


def _negative(method: Any) -> bool:
    return method is not None and bool(getattr(method, "is_negative", False))


def invalid_only_before_serialization(case: Any) -> bool:
    """A negative case whose request, once serialized, is one the schema admits."""
    if not _negative(case.data_generation_method):
        return False
    meta = case.meta
    if meta is None:
        return False
    # Another part of the request is the invalid one: keep the case.
    for method, data in (
        (meta.path_parameters, case.path_parameters),
        (meta.headers, None),
        (meta.cookies, case.cookies),
        (meta.body, case.body),
    ):
        if _negative(method) and data:
            return False
    if meta.headers is not None and _negative(meta.headers):
        return False
    declared = {p.name: p.definition.get("schema", {}) for p in case.operation.query}
    sent = {k: v for k, v in (case.query or {}).items() if not _vanishes(v)}
    if set(sent) - set(declared):
        return False
    return all(jsonschema.Draft4Validator(declared[k]).is_valid(v) for k, v in sent.items())


@schemathesis.hook
def before_generate_case(context: Any, strategy: Any) -> Any:
    return strategy.filter(lambda case: not invalid_only_before_serialization(case))
