"""Driver <-> rank messages on the wire: registered dataclasses as signed frames.

A message becomes ZeroMQ multipart frames, no pickle (a peer that reaches the port must not be
able to run code in the server):

    frame 0        JSON header: {"m": [{"t": type name, "f": plain fields,
                                        "a": [[field, dtype, shape], ...]}, ...]}
    frames 1..n    the numpy arrays' bytes (C order), message after message, in the header's order
    last frame     HMAC-SHA256 over every frame before it (length-prefixed) with the gang's key

One message is a bundle of one (``encode`` / ``decode``); ``encode_many`` / ``decode_many`` carry
several under one signature and one send (what a busy peer queued in one event-loop turn).

``decode`` checks the signature (constant-time) before it parses anything and only builds the
message types registered in ``MESSAGE_TYPES``: the runtime's own (``messages.py``) and those each
program registers with ``register_messages`` when its module is imported (on the driver and on
every rank alike); anything else is a ``WireError``.

    frames = encode(Batch(3, ids, mask), key)      # list[bytes]
    msg = decode(frames, key)                      # Batch(mb_id=3, ...), arrays writable copies
    msgs = decode_many(encode_many([a, b], key), key)   # [a, b]; decode_many takes encode's too
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import secrets
from typing import Any

import numpy as np

from shardserve.partitioner.runtime.messages import Heartbeat, RankFailed, RankReady, RankStopped

MESSAGE_TYPES: dict[str, type] = {}
KEY_BYTES = 32


def register_messages(*types: type) -> None:
    """Let these dataclasses cross the wire (a program's own messages). A name already taken by
    another type is an error: decoding must know which class a name means."""
    for cls in types:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"{cls!r} is not a dataclass")
        known = MESSAGE_TYPES.setdefault(cls.__name__, cls)
        if known is not cls:
            raise ValueError(
                f"message type name {cls.__name__!r} is taken by {known.__module__}.{known.__qualname__}"
            )


register_messages(RankReady, RankStopped, RankFailed, Heartbeat)


class WireError(ValueError):
    """Frames that are not a signed message of a known type (tampered, foreign, or corrupt)."""


def new_key() -> bytes:
    """A fresh random gang key."""
    return secrets.token_bytes(KEY_BYTES)


def _signature(frames: list[bytes], key: bytes) -> bytes:
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for frame in frames:
        mac.update(len(frame).to_bytes(8, "little"))
        mac.update(frame)
    return mac.digest()


def encode(msg: Any, key: bytes) -> list[bytes]:
    """``msg`` (one of ``MESSAGE_TYPES``) as signed frames."""
    return encode_many([msg], key)


def encode_many(msgs: list[Any], key: bytes) -> list[bytes]:
    """``msgs`` (each one of ``MESSAGE_TYPES``, at least one) as one signed set of frames."""
    if not msgs:
        raise WireError("nothing to encode")
    headers: list[dict[str, Any]] = []
    frames: list[bytes] = [b""]
    for msg in msgs:
        name = type(msg).__name__
        if MESSAGE_TYPES.get(name) is not type(msg):
            raise WireError(f"{name} is not a wire message type")
        plain: dict[str, Any] = {}
        arrays: list[list[Any]] = []
        for f in dataclasses.fields(msg):
            value = getattr(msg, f.name)
            if isinstance(value, np.ndarray):
                value = np.ascontiguousarray(value)
                arrays.append([f.name, value.dtype.str, list(value.shape)])
                frames.append(value.tobytes())
            else:
                plain[f.name] = value
        headers.append({"t": name, "f": plain, "a": arrays})
    frames[0] = json.dumps({"m": headers}, separators=(",", ":")).encode()
    frames.append(_signature(frames, key))
    return frames


def decode(frames: list[bytes], key: bytes) -> Any:
    """The one message in ``frames``; ``WireError`` unless correctly signed and well-formed."""
    msgs = decode_many(frames, key)
    if len(msgs) != 1:
        raise WireError(f"one message expected, {len(msgs)} sent")
    return msgs[0]


def decode_many(frames: list[bytes], key: bytes) -> list[Any]:
    """The messages in ``frames``, in the order encoded; ``WireError`` unless correctly signed and
    well-formed (nothing is built from frames that fail the signature)."""
    if len(frames) < 2:
        raise WireError(f"a message has a header and a signature, got {len(frames)} frame(s)")
    body, signature = [bytes(f) for f in frames[:-1]], bytes(frames[-1])
    if not hmac.compare_digest(_signature(body, key), signature):
        raise WireError("bad signature (another gang's key, or a foreign sender)")
    try:
        headers = json.loads(body[0])["m"]
        announced = sum(len(h["a"]) for h in headers)
        if announced != len(body) - 1:
            raise WireError(f"{announced} arrays announced, {len(body) - 1} sent")
        out, data = [], iter(body[1:])
        for header in headers:
            cls = MESSAGE_TYPES[header["t"]]
            kwargs = dict(header["f"])
            for name, dtype, shape in header["a"]:
                kwargs[name] = np.frombuffer(next(data), dtype=np.dtype(dtype)).reshape(shape).copy()
            out.append(cls(**kwargs))
        return out
    except WireError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"malformed message: {exc}") from None
