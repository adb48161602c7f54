"""Model folders without tokenizer files: the bundled BERT-uncased tokenizer only where it is the
model's own vocabulary (BERT / DistilBERT config, same vocab_size), with a warning; else a refusal
that names the folder.

python -m pytest tests/models/test_registry.py -q
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from shardserve.cli import main
from shardserve.models.bundled import minilm_dir
from shardserve.models.config import ModelConfigError
from shardserve.models.registry import resolve_model


def _config_only(tmp_path: Path, preset: str, **changes: object) -> Path:
    """A model folder holding only the preset's config.json (with ``changes``): no tokenizer files."""
    folder = tmp_path / f"{preset}-no-tokenizer"
    folder.mkdir()
    cfg = json.loads((resolve_model(preset).checkpoint / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, **changes}))
    return folder


def test_roberta_folder_without_tokenizer_is_refused_naming_the_folder(tmp_path: Path) -> None:
    folder = _config_only(tmp_path, "tiny-roberta")
    with pytest.raises(ModelConfigError, match=r"no tokenizer files \(tokenizer.json / vocab.txt") as info:
        resolve_model(str(folder))
    assert str(folder) in str(info.value) and "roberta" in str(info.value)


def test_bert_folder_with_another_vocab_size_is_refused(tmp_path: Path) -> None:
    folder = _config_only(tmp_path, "tiny-bert", vocab_size=28996)  # BERT-base cased
    with pytest.raises(ModelConfigError, match="vocab_size=28996"):
        resolve_model(str(folder))


@pytest.mark.parametrize("preset", ["tiny-bert", "tiny-distilbert"])
def test_bert_uncased_folder_falls_back_with_a_warning(
    tmp_path: Path, preset: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _config_only(tmp_path, preset)
    with caplog.at_level(logging.WARNING, logger="shardserve.models.registry"):
        source = resolve_model(str(folder))
    assert source.tokenizer_dir == minilm_dir()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(folder) in warnings[0] and "bundled BERT-uncased" in warnings[0]


def test_a_folder_with_its_own_tokenizer_keeps_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    folder = _config_only(tmp_path, "tiny-roberta")
    for name in ("vocab.json", "merges.txt"):  # byte-level BPE files count as a tokenizer too
        (folder / name).write_text("{}" if name.endswith("json") else "#version: 0.2\n")
    with caplog.at_level(logging.WARNING, logger="shardserve.models.registry"):
        assert resolve_model(str(folder)).tokenizer_dir == folder
    assert not caplog.records
    bert = _config_only(tmp_path, "tiny-bert")
    shutil.copy(minilm_dir() / "vocab.txt", bert)
    assert resolve_model(str(bert)).tokenizer_dir == bert


def test_verify_of_a_roberta_folder_without_tokenizer_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    folder = _config_only(tmp_path, "tiny-roberta")
    assert main(["verify", "--model", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no tokenizer files") and "\n" not in err and str(folder) in err
