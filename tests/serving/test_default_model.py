"""The shipped default model answers through ``shardserve serve`` exactly what ``shardserve eval`` measured.

A sample of development-set questions (every 150th of the 42-article pool: 59 questions over 38
articles, some with contexts longer than one window) goes to a server built with no flags but the
model (what ``shardserve serve`` runs: default precision, windows, replicas and threads), 8 requests
in flight so the scheduler batches them together; the answers must be the eval path's answers for
the same questions at the same windows and precision (``shardserve.training.evaluate.predict_answers``).

In float32 every answer is identical. In bfloat16 the server's batches (other requests beside it,
padding to a length bucket) round differently from eval's, so a span that nearly ties with another
may flip: there every difference must be such a tie - eval's answer is in the server's top 3 within
a log-score gap of 1.0 (each of the two spans' start and end logits may move by the bf16 logit
bound of ``shardserve verify``, 0.25) - and at least 90 % of the answers must be identical.

    python -m pytest tests/serving/test_default_model.py -q     (~1 min on 2 cores)
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from shardserve.models.bundled import DEFAULT_OVERLAY_DIR
from shardserve.serving.frontend.app import build_app
from shardserve.serving.frontend.settings import ServeSettings
from shardserve.training.evaluate import EvalConfig, predict_answers
from tests.serving.frontend.api_helpers import wait_until

EVERY = 150  # sample stride over the pool's 8,727 questions

pytestmark = pytest.mark.skipif(
    not any(DEFAULT_OVERLAY_DIR.glob("*.safetensors")), reason="no shipped default overlay"
)


def sample_file(pool: Path, dest: Path) -> Path:
    """A SQuAD file holding every EVERY-th question of ``pool`` (articles and paragraphs kept)."""
    data = json.loads(pool.read_text())
    k = 0
    for article in data["data"]:
        for para in article["paragraphs"]:
            kept = []
            for qa in para["qas"]:
                if k % EVERY == 0:
                    kept.append(qa)
                k += 1
            para["qas"] = kept
        article["paragraphs"] = [p for p in article["paragraphs"] if p["qas"]]
    data["data"] = [a for a in data["data"] if a["paragraphs"]]
    dest.write_text(json.dumps(data))
    return dest


@pytest.mark.parametrize("dtype", ["auto", "float32"])  # auto: bf16 where the CPU has bf16 units
def test_serve_answers_what_eval_measured(squad_dir, tmp_path, dtype):
    settings = ServeSettings(model="default", dtype=dtype)  # `shardserve serve` with no other flag
    sample = sample_file(squad_dir / "squad-v1.1-train-pool.json", tmp_path / "sample.json")
    examples, want = predict_answers(
        EvalConfig(model="default", data=str(sample), window=settings.window(), dtype=settings.dtype),
        show_progress=False,
    )
    assert len(examples) == 59
    assert len({ex.title for ex in examples}) > 30

    with TestClient(build_app(settings)) as client:
        wait_until(lambda: client.app.state.manager.ready >= 1, timeout=180, what="default model ready")

        def ask(ex) -> tuple[str, dict]:
            r = client.post("/v1/qa", json={"question": ex.question, "context": ex.context, "top_k": 3})
            assert r.status_code == 200, r.text
            return ex.id, r.json()

        with ThreadPoolExecutor(8) as pool:
            got = dict(pool.map(ask, examples))
        precision = client.app.state.precision.name
    assert max(body["windows"] for body in got.values()) > 1  # long contexts are in the sample
    differ = {qid: body["answers"] for qid, body in got.items() if body["answers"][0]["text"] != want[qid]}
    if precision == "float32":
        assert not differ, (differ, want)
        return
    assert len(differ) <= 0.1 * len(examples), (differ, want)
    for qid, answers in differ.items():
        tie = [a for a in answers if a["text"] == want[qid]]
        assert tie and math.log(answers[0]["score"] / tie[0]["score"]) <= 1.0, (answers, want[qid])
