"""Bodies the JSON parser gives up on (``serving/frontend/http/json_body.py``): nesting deeper than its stack and
integer literals over Python's digit limit are JSON decode errors of the route, with the reason,
not a bare 400 "There was an error parsing the body".

Run: python -m pytest tests/serving/frontend/http/test_json_body.py -q      (fake in-process gangs; a few seconds)
"""

from __future__ import annotations

import sys

import pytest

from tests.serving.frontend.api_helpers import TOKEN, serving

DEEP = b"[" * 5000 + b"]" * 5000
HUGE_INT = b'{"question": ' + b"7" * (sys.get_int_max_str_digits() + 1) + b"}"
JSON = {"content-type": "application/json", "Authorization": f"Bearer {TOKEN}"}


@pytest.mark.parametrize(
    ("body", "reason"),
    [(DEEP, "nesting too deep"), (HUGE_INT, f"more than {sys.get_int_max_str_digits()} digits")],
    ids=["deep", "huge int"],
)
def test_unparsable_json_is_a_json_decode_error_with_its_reason(body: bytes, reason: str) -> None:
    with serving(served_model_name="m") as (client, _):
        for path in ("/v1/qa", "/v1/qa/batch", "/admin/replicas", "/admin/reload"):
            r = client.post(path, content=body, headers=JSON)
            assert r.status_code == 422, (path, r.text)
            reply = r.json()
            assert reply["error"] == "invalid_request" and reply["detail"].startswith(
                "body: JSON decode error"
            )
            assert reason in reply["detail"], reply
            assert [e["type"] for e in reply["errors"]] == ["json_invalid"]
            plain = client.post(path, content=b"{bad", headers=JSON).json()  # an ordinary decode error
            assert (plain["error"], plain["errors"][0]["type"]) == ("invalid_request", "json_invalid")
        r = client.post("/v2/models/m/infer", content=body, headers=JSON)
        assert r.status_code == 400 and r.json().keys() == {"error"}, r.text
        assert r.json()["error"].startswith("body: JSON decode error") and reason in r.json()["error"]
