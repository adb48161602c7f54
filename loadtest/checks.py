"""Checks used by the load generator (pure Python, no locust import): answer consistency and the
loopback-only rule for targets.

    check_answers(body, context, top_k=1)   # None when fine, else a one-line reason
    is_loopback_host("http://127.0.0.1:8000")   # True; a load test refuses other hosts by default

An answer is consistent when it has ``text``, ``score``, ``start``, ``end``, the offsets lie inside
the context and ``context[start:end] == text``. Tests: ``tests/loadtest/test_data.py``.
"""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse
from typing import Any


def check_answers(body: Any, context: str, *, top_k: int) -> str | None:
    """Why a /v1/qa body is inconsistent with its context, or None when every offset matches."""
    if not isinstance(body, dict) or not isinstance(body.get("answers"), list):
        return f"no 'answers' list in {str(body)[:120]!r}"
    answers = body["answers"]
    if len(answers) > top_k:
        return f"{len(answers)} answers for top_k={top_k}"
    for i, ans in enumerate(answers):
        try:
            text, start, end = ans["text"], int(ans["start"]), int(ans["end"])
            float(ans["score"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"answer {i} malformed ({exc}): {str(ans)[:120]!r}"
        if not 0 <= start <= end <= len(context):
            return f"answer {i} offsets [{start}, {end}) outside context of length {len(context)}"
        if context[start:end] != text:
            return f"answer {i} text {text!r} != context[{start}:{end}] = {context[start:end]!r}"
    return None


def is_loopback_host(url: str) -> bool:
    """True when ``url``'s host is localhost or resolves only to loopback addresses."""
    host = urllib.parse.urlsplit(url).hostname
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)
