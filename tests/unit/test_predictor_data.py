"""Predictor training data: corpus reading, the document split, windows, and the batched prefill."""

from __future__ import annotations

import pytest
import torch

from pipeline.model.config import tiny_config
from pipeline.model.partition import LayerRange
from pipeline.model.row_layout import Span
from pipeline.model.stage_model import build_stage_model
from pipeline.training.data import (
    Corpus,
    Document,
    collect_hidden_states,
    load_corpus,
    split_documents,
    token_windows,
)
from tests.tiny_model import random_state_dict


def _byte_encode(text: str) -> list[int]:
    return list(text.encode())


def test_split_is_document_level_deterministic_and_non_empty():
    corpus = Corpus("c", [Document(f"doc{i}.txt", f"text {i}") for i in range(40)])
    train, held = split_documents(corpus)
    assert held and train
    assert {d.doc_id for d in train}.isdisjoint(d.doc_id for d in held)
    assert len(train) + len(held) == 40
    assert split_documents(corpus) == (train, held)
    bigger = Corpus("c", corpus.documents + [Document("new.txt", "x")])
    assert set(d.doc_id for d in held) <= set(d.doc_id for d in split_documents(bigger)[1])


def test_windows_round_robin_over_documents():
    docs = [Document("a", "a" * 40), Document("b", "b" * 20)]
    w = token_windows(_byte_encode, docs, window=10, num_tokens=30)
    assert w.shape == (3, 10)
    assert [chr(row[0]) for row in w.tolist()] == ["a", "b", "a"]
    with pytest.raises(ValueError, match="no document has 100 tokens"):
        token_windows(_byte_encode, docs, window=100, num_tokens=30)


def test_corpus_from_folder_and_txt(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "one.txt").write_text("hello")
    (tmp_path / "d" / "two.txt").write_text("world")
    assert [d.doc_id for d in load_corpus(str(tmp_path / "d")).documents] == ["one.txt", "two.txt"]
    (tmp_path / "f.txt").write_text("\n\n".join(f"para {i}" for i in range(45)))
    assert len(load_corpus(str(tmp_path / "f.txt")).documents) == 3
    with pytest.raises(FileNotFoundError):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text"):
        load_corpus(str(tmp_path / "empty"))


def test_collected_states_match_the_stage_model():
    config = tiny_config()
    n = config.num_hidden_layers
    model = build_stage_model(config, LayerRange(0, n), is_first=True, is_last=True,
                              tensors=random_state_dict(config, seed=3))
    windows = torch.randint(0, config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
    data = collect_hidden_states(model, windows, layers=[1, n - 1], batch_size=2)
    assert data.hidden[1].shape == (3, 12, config.hidden_size)
    for w in range(3):  # reference: one window at a time, prefix by prefix
        for t in (0, 5, 11):
            kv = model.new_kv_cache(max_num_seqs=1, max_model_len=12)
            out = model.forward_rows(windows[w, :t + 1], [Span(0, 0, t + 1)], kv, exit_layer=1)
            logits, exit_hidden = out.out, out.exit_hidden
            assert int(logits.argmax(-1)) == int(data.targets[w, t])
            torch.testing.assert_close(exit_hidden[0], data.hidden[1][w, t], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="outside"):
        collect_hidden_states(model, windows, layers=[n])
