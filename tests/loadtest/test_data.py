"""Question sources for the load generator: SQuAD files and the generated fallback.

python -m pytest tests/loadtest/test_data.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardserve.loadtest.checks import check_answers
from shardserve.loadtest.data import generate_items, load_qa_items, read_squad


def test_read_squad_pairs_questions_with_contexts(tmp_path: Path) -> None:
    doc = {
        "data": [
            {
                "title": "t",
                "paragraphs": [
                    {
                        "context": "Paris is in France.",
                        "qas": [{"question": "Where is Paris?"}, {"question": " "}],
                    },
                    {"context": "Rome is in Italy.", "qas": [{"question": "Where is Rome?"}]},
                ],
            }
        ]
    }
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    items = read_squad(path)
    assert [(i.question, i.context) for i in items] == [
        ("Where is Paris?", "Paris is in France."),
        ("Where is Rome?", "Rome is in Italy."),
    ]
    assert len(read_squad(path, limit=1)) == 1


def test_read_squad_rejects_other_json(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="not SQuAD format"):
        read_squad(path)


def test_generated_items_are_deterministic_and_varied() -> None:
    a, b = generate_items(20, seed=3), generate_items(20, seed=3)
    assert a == b
    assert len({len(i.context) for i in a}) > 3
    assert all(i.question.endswith("?") and i.context for i in a)


def test_shared_squad_pool_is_used_when_present(squad_dir: Path) -> None:
    items = load_qa_items(None, limit=50)
    expected = read_squad(squad_dir / "squad-v1.1-train-pool.json", limit=50)
    assert items == expected


def test_check_answers_accepts_matching_offsets_and_names_mismatches() -> None:
    ctx = "Denver Broncos won Super Bowl 50."
    good = {"answers": [{"text": "Denver Broncos", "score": 0.9, "start": 0, "end": 14}]}
    assert check_answers(good, ctx, top_k=1) is None
    assert check_answers({"answers": []}, ctx, top_k=1) is None
    bad = {"answers": [{"text": "Broncos", "score": 0.9, "start": 0, "end": 14}]}
    assert "!= context[0:14]" in check_answers(bad, ctx, top_k=1)
    out = {"answers": [{"text": "x", "score": 0.1, "start": 30, "end": 99}]}
    assert "outside context of length 33" in check_answers(out, ctx, top_k=1)
    assert "2 answers for top_k=1" in check_answers({"answers": [good["answers"][0]] * 2}, ctx, top_k=1)
    assert "no 'answers' list" in check_answers({"detail": "x"}, ctx, top_k=1)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ('{"data": [{"title": "trunc', "not valid JSON .Unterminated string"),
        ('{"data": [1, "x", {"paragraphs": [2, {"context": "c", "qas": 3}]}]}', "no questions found"),
        ('{"data": [{"paragraphs": [{"text": "abc"}]}]}', "no questions found"),
    ],
)
def test_read_squad_names_the_file_for_any_unusable_content(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "q.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=needle) as info:
        read_squad(path)
    assert str(path) in str(info.value)
