"""Triton's model configuration extension (serving/frontend/v2/model_config.py): the config of each
served model matches its metadata, is listed in the server's extensions, needs the API key when one
is set, and Triton's HTTP client reads it; on fake gangs.

Run: python -m pytest tests/serving/frontend/v2/test_model_config.py -q
"""

from __future__ import annotations

import pytest

from shardserve.partitioner.runtime.fake_gang import FakeFactory
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.serving.frontend.api_helpers import serving
from tests.serving.live import live_server

TYPES = {"BYTES": "TYPE_STRING", "FP32": "TYPE_FP32", "INT64": "TYPE_INT64", "BOOL": "TYPE_BOOL"}


def test_each_model_s_config_describes_the_tensors_of_its_metadata() -> None:
    with serving(model=["a=tiny-bert", "b=tiny-bert"]) as (client, _):
        assert "model_configuration" in client.get("/v2").json()["extensions"]
        for name in ("a", "b"):
            config = client.get(f"/v2/models/{name}/config").json()
            meta = client.get(f"/v2/models/{name}").json()
            assert config["name"] == name and config["max_batch_size"] == 0
            for side, tensors in (("input", "inputs"), ("output", "outputs")):
                assert [(t["name"], t["data_type"], t["dims"]) for t in config[side]] == [
                    (t["name"], TYPES[t["datatype"]], t["shape"]) for t in meta[tensors]
                ]
        assert [t["name"] for t in config["input"]] == ["question", "context"]
        missing = client.get("/v2/models/nope/config")
        assert missing.status_code == 404 and "nope" in missing.json()["error"]


def test_the_config_needs_the_api_key_when_one_is_set() -> None:
    with serving(api_key="k3y") as (client, _):
        refused = client.get("/v2/models/tiny-bert/config")
        assert refused.status_code == 401 and "error" in refused.json()
        ok = client.get("/v2/models/tiny-bert/config", headers={"Authorization": "Bearer k3y"})
        assert ok.status_code == 200 and ok.json()["name"] == "tiny-bert"


def test_tritonclient_http_reads_the_config() -> None:
    httpclient = pytest.importorskip("tritonclient.http")
    factory = FakeFactory()
    settings = ServeSettings(model="tiny-bert", replicas=1, max_queue_delay_ms=1.0)
    with live_server(build_app(settings, backend_factory=factory), ready_timeout_s=30) as base:
        client = httpclient.InferenceServerClient(base.removeprefix("http://"))
        try:
            config = client.get_model_config("tiny-bert")
            assert config["max_batch_size"] == 0
            assert {t["name"]: t["data_type"] for t in config["output"]}["score"] == "TYPE_FP32"
        finally:
            client.close()
