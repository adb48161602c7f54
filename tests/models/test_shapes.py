"""Public models' shapes for planning: each builds an EncoderConfig with the published parameter count."""

from __future__ import annotations

import pytest

from shardserve.models.config import ModelConfigError
from shardserve.models.shapes import SHAPES, shape_config
from shardserve.partitioner.cost import analytic_costs

# published sizes (the model cards; BERT's include a pooler the QA model does not have)
PUBLISHED = {
    "minilm-l6": 22.7e6,
    "bert-base": 110e6,
    "bert-large": 335e6,
    "roberta-large": 355e6,
    "qwen2-0.5b": 494e6,
    "qwen2-1.5b": 1.54e9,
}


@pytest.mark.parametrize("name", list(SHAPES))
def test_each_shape_has_its_published_size(name: str) -> None:
    params = sum(u.params for u in analytic_costs(shape_config(name), seq_len=384))
    assert params == pytest.approx(PUBLISHED[name], rel=0.02)


def test_an_unknown_shape_names_the_known_ones() -> None:
    with pytest.raises(ModelConfigError, match=r"no model shape 'gpt-5'.*qwen2-1\.5b"):
        shape_config("gpt-5")
