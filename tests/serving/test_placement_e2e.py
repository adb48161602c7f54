"""Two models on one shared gang of REAL worker processes (``--placement multiplexed``: tiny-bert
and tiny-roberta, each split pp=2 over the same two devices): every answer of each model equals
that model alone in this process, and kill -9 of a shared rank under load of both models loses no
request (each is answered, or refused 503 while no gang is up) until one fresh gang serves both.

Run: python -m pytest tests/serving/test_placement_e2e.py -q       (~40 s on 2 cores)
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from tests.clients import closed_loop
from tests.serving.frontend.api_helpers import wait_until
from tests.serving.test_e2e import PAIRS, reference_answer

MODELS = ("bert", "roberta")


@pytest.fixture(scope="module")
def shared() -> Iterator[TestClient]:
    settings = ServeSettings(
        model=["bert=tiny-bert", "roberta=tiny-roberta"],
        placement="multiplexed",
        devices=2,
        single_latency_ms=20.0,
        threads_per_rank=1,
        dtype="float32",
        max_seq_len=128,
        doc_stride=32,
        max_question_len=32,
        length_buckets=[64, 128],
        restart_backoff_s=0.1,
    )
    with TestClient(build_app(settings)) as client:
        models = client.app.state.models
        wait_until(lambda: models.ready(), timeout=120, what="both models ready on the shared gang")
        yield client


def _managers(client: TestClient) -> dict[str, object]:
    return {name: client.app.state.models.engine(name).manager for name in MODELS}


def test_both_models_on_one_real_gang_answer_as_each_model_alone(shared: TestClient) -> None:
    managers = _managers(shared)
    pids = {name: tuple(m.routable()[0].backend.pids()) for name, m in managers.items()}
    assert pids["bert"] == pids["roberta"] and len(pids["bert"]) == 2  # one gang, two ranks
    asks = [(name, q, c) for name in MODELS for q, c in PAIRS]
    with ThreadPoolExecutor(8) as pool:
        responses = list(
            pool.map(
                lambda a: shared.post(
                    "/v1/qa", json={"model": a[0], "question": a[1], "context": a[2], "top_k": 3}
                ),
                asks * 2,
            )
        )
    assert [r.status_code for r in responses] == [200] * len(responses)
    refs = {a: reference_answer(shared, a[1], a[2], model=managers[a[0]].model) for a in asks}
    for ask, r in zip(asks * 2, responses, strict=True):
        body, ref = r.json(), refs[ask]
        best = body["answers"][0]
        assert body["model"] == ask[0] and body["windows"] == ref["windows"]
        assert (best["text"], best["start"], best["end"]) == ref["best"], ask
    # the models differ on some question, so an answer from the wrong model would fail above
    assert any(refs[("bert", q, c)]["best"] != refs[("roberta", q, c)]["best"] for q, c in PAIRS)


def test_kill9_of_a_shared_rank_fails_no_request_of_either_model(shared: TestClient) -> None:
    managers = _managers(shared)
    victim_pids = managers["bert"].routable()[0].backend.pids()
    statuses: dict[str, list[int]] = {name: [] for name in MODELS}

    def ask(i: int) -> None:
        name = MODELS[i % 2]
        q, c = PAIRS[i % len(PAIRS)]
        r = shared.post("/v1/qa", json={"model": name, "question": q, "context": c})
        statuses[name].append(r.status_code)
        if r.status_code == 200:
            a = r.json()["answers"][0]
            assert c[a["start"] : a["end"]] == a["text"]

    with closed_loop(ask, n=4):
        wait_until(lambda: min(map(len, statuses.values())) > 5, timeout=30, what="traffic of both")
        os.kill(victim_pids[1], signal.SIGKILL)  # the last stage of the shared gang
        wait_until(
            lambda: all(m.restarts >= 1 and m.ready == 1 for m in managers.values()),
            timeout=90,
            what="one fresh gang serving both models",
        )
        counts = {name: len(s) for name, s in statuses.items()}
        wait_until(
            lambda: all(len(statuses[n]) > counts[n] + 5 for n in MODELS), timeout=30, what="traffic after"
        )
    for name, codes in statuses.items():
        assert set(codes) <= {200, 503}, (name, sorted(set(codes)))
        assert codes[-1] == 200 and codes.count(200) > 10, name
    new = [tuple(m.routable()[0].backend.pids()) for m in managers.values()]
    assert new[0] == new[1] and not set(new[0]) & set(victim_pids)  # again one gang for both
