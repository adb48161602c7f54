"""Native and admin routes (``serving/frontend/rest/routes.py``): the admin token before the body, the replica cap
of a pinned count, one reply for every unloadable reload target, and 422s naming a batch item's field.

Run: python -m pytest tests/serving/frontend/rest/test_routes.py -q      (fake in-process gangs; a few seconds)
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from shardserve.models.hf_weights import CheckpointError
from shardserve.models.registry import resolve_model
from shardserve.serving.config import FleetConfig
from shardserve.serving.fleet.model_loader import load_generation
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, TOKEN, serving

AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
NO_TOKENS = "\u0301\u0301"  # combining accents only: printable, but the tokenizer keeps none of them


@pytest.mark.parametrize("body", [b"garbage", b'{"replicas": "2"}', b'{"model": 3}'])
def test_admin_token_is_checked_before_the_body_is_parsed(body: bytes) -> None:
    """Without the token, a bad body was a 422 naming the body: a 401 comes first."""
    with serving() as (client, _):
        for path in ("/admin/replicas", "/admin/reload"):
            for headers in (JSON, {**JSON, "Authorization": "Bearer wrong"}):
                r = client.post(path, content=body, headers=headers)
                assert r.status_code == 401, (path, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
                assert r.json()["error"] == "unauthorized"
            assert client.post(path, content=body, headers={**JSON, **AUTH}).status_code == 422
    with serving(admin_token=None) as (client, _):
        r = client.post("/admin/reload", content=body, headers={**JSON, **AUTH})
        assert r.status_code == 401 and r.json()["error"] == "admin_disabled"


@pytest.mark.parametrize("count", ["4", "1000000000000000000000000000000", "1e300"])
def test_a_pinned_count_over_the_cap_is_a_422_naming_it(count: str) -> None:
    """``{"replicas": 1e30}`` was a 200 pinning 1e30 and taking the whole pool."""
    with serving(cpu_slots=3) as (client, _):
        before = client.get("/admin/replicas", headers=AUTH).json()
        r = client.post("/admin/replicas", content=f'{{"replicas": {count}}}', headers={**JSON, **AUTH})
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_request" and "exceeds the cap of 3" in r.json()["detail"]
        after = client.get("/admin/replicas", headers=AUTH).json()
        assert (after["target"], after["pinned"]) == (before["target"], before["pinned"])
        ok = client.post("/admin/replicas", json={"replicas": 3}, headers=AUTH)
        assert ok.status_code == 200 and (ok.json()["target"], ok.json()["pinned"]) == (3, 3)
        schema = client.get("/openapi.json").json()["components"]["schemas"]["ReplicasRequest"]
        assert {b.get("maximum") for b in schema["properties"]["replicas"]["anyOf"]} == {3, None}


@pytest.mark.parametrize("text", ["", "{}", "not json"])
def test_a_corrupt_tokenizer_is_not_a_loadable_model(tmp_path: Path, text: str) -> None:
    """A corrupt tokenizer.json was a 422 with the parser's message ("'/dir': Expecting value: ...")
    or, for ``{}``, a 500; every unloadable model gets the same reply, the reason in the log."""
    broken = tmp_path / "broken"
    shutil.copytree(resolve_model("tiny-bert").tokenizer_dir, broken)
    (broken / "tokenizer.json").write_text(text, encoding="utf-8")
    with pytest.raises(CheckpointError, match="the tokenizer cannot be loaded"):
        load_generation(FleetConfig(), str(broken), generation=1)
    with serving() as (client, factory):
        replies = []
        for target in (str(broken), str(tmp_path / "missing")):
            r = client.post("/admin/reload", json={"model": target}, headers=AUTH)
            assert r.status_code == 422 and r.json()["error"] == "invalid_model", r.text
            replies.append(r.json()["detail"].replace(repr(target), "MODEL"))
        assert replies[0] == replies[1] and "the server log has the reason" in replies[0]
        assert factory.models == ["tiny-bert"] * len(factory.models)  # nothing started


def test_a_context_without_tokens_is_named_like_every_other_input_error() -> None:
    """The tokenizer's error said ``context: pair 1: context yields no tokens`` where every other 422
    of a batch names ``items[1].context``."""
    with serving(max_context_chars=100) as (client, _):
        items = [
            {"question": QUESTION, "context": "Ann met Bob."},
            {"question": QUESTION, "context": NO_TOKENS},
        ]
        r = client.post("/v1/qa/batch", json={"items": items})
        assert r.status_code == 422 and r.json()["detail"] == "items[1].context: yields no tokens", r.text
        items[1]["context"] = CONTEXT  # over max_context_chars: the route's own check, for the form
        detail = client.post("/v1/qa/batch", json={"items": items}).json()["detail"]
        assert detail.startswith("items[1].context: has 2"), detail
        r = client.post("/v1/qa", json={"question": QUESTION, "context": NO_TOKENS})
        assert r.status_code == 422 and r.json()["detail"] == "context: yields no tokens", r.text
