"""How a 422 says what to fix (``dashboard/api/schemas.py::explain``), from the errors pydantic
gives for real request bodies: a field that is not there is named; a value that fits no member
of a union is explained by the member it was meant for (an object port's bad field, not "no
integer"), else by the first."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from dashboard.api.sandboxes import SandboxIn
from dashboard.api.schemas import explain


def _detail(body: dict) -> str:
    with pytest.raises(ValidationError) as info:
        SandboxIn.model_validate({"image": "busybox", **body})
    # As ninja gives them: located in the request's body, under the payload's name.
    return explain([{**e, "loc": ("body", "payload", *e["loc"])} for e in info.value.errors()])


@pytest.mark.parametrize(
    ("body", "detail"),
    [
        ({"timout_s": 60}, "timout_s: not a field of this request"),
        ({"ports": [{"port": 8000, "zz": 1}]}, "ports.0.zz: not a field of this request"),
        ({"ports": [{"port": 70000}]}, "ports.0.port: Input should be less than or equal to 65535"),
        ({"ports": [70000]}, "ports.0: Input should be less than or equal to 65535"),
        ({"ports": ["x"]}, "ports.0: Input should be a valid integer"),
        ({"ports": [8000, {"port": 1, "public": "no"}]}, "ports.1.public: Input should be a valid boolean"),
    ],
)
def test_a_422_names_the_field_and_the_member_it_was_meant_for(body, detail):
    got = _detail(body)
    assert got.startswith(detail) and ";" not in got, got
