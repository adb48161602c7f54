"""Compressed request bodies: gzip and deflate inflated before parsing (within max_body_bytes: a
small body that inflates past it is a 413), an unknown coding a 415, a corrupt or cut-off one a 400;
through the app, a gzip JSON body answers as the plain one.

Run: python -m pytest tests/serving/frontend/http/test_content_encoding.py -q      (a few seconds)
"""

from __future__ import annotations

import gzip
import json
import zlib

import pytest

from shardserve.serving.frontend.http.content_encoding import BodyEncodingError, inflate
from tests.serving.frontend.api_helpers import CONTEXT, QUESTION, serving

BODY = json.dumps({"question": QUESTION, "context": CONTEXT}).encode()


@pytest.mark.parametrize(
    ("encoded", "coding"),
    [
        (gzip.compress(BODY), "gzip"),
        (zlib.compress(BODY), "deflate"),
        (BODY, "identity"),
        (gzip.compress(zlib.compress(BODY)), "deflate, gzip"),  # applied in order: gzip last
        (gzip.compress(BODY), " GZIP , identity"),
    ],
)
def test_inflates_each_coding(encoded: bytes, coding: str) -> None:
    assert inflate(encoded, coding, limit=len(BODY)) == BODY


@pytest.mark.parametrize(
    ("encoded", "coding", "limit", "status", "needle"),
    [
        (gzip.compress(b"\0" * 10_000_000), "gzip", 1 << 20, 413, "inflates (gzip) to over 1048576 bytes"),
        (gzip.compress(BODY), "br", 1 << 20, 415, "Content-Encoding 'br'"),
        (b"not gzip at all", "gzip", 1 << 20, 400, "body is not valid gzip"),
        (gzip.compress(BODY)[:-12], "gzip", 1 << 20, 400, "cut off"),
    ],
)
def test_bad_encodings_say_why(encoded: bytes, coding: str, limit: int, status: int, needle: str) -> None:
    with pytest.raises(BodyEncodingError) as caught:
        inflate(encoded, coding, limit=limit)
    assert caught.value.status == status and needle in caught.value.detail, caught.value.detail


def test_a_gzip_body_answers_as_the_plain_one_and_a_bomb_is_413() -> None:
    with serving(max_body_bytes=4096) as (client, _):
        plain = client.post("/v1/qa", content=BODY, headers={"content-type": "application/json"})
        zipped = client.post(
            "/v1/qa",
            content=gzip.compress(BODY),
            headers={"content-type": "application/json", "content-encoding": "gzip"},
        )
        assert zipped.status_code == plain.status_code == 200, zipped.text
        assert zipped.json()["answers"] == plain.json()["answers"]
        bomb = client.post(
            "/v1/qa", content=gzip.compress(b" " * 100_000), headers={"content-encoding": "gzip"}
        )
        assert bomb.status_code == 413 and bomb.json()["error"] == "body_too_large", bomb.text
        brotli = client.post("/v1/qa", content=BODY, headers={"content-encoding": "br"})
        assert brotli.status_code == 415 and brotli.json()["error"] == "unsupported_content_encoding"
