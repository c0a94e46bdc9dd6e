"""Scoring: NLL of scored tokens against a plain computation with transformers."""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cortiq.cli import main
from cortiq.convert.hf import convert_hf_dir
from cortiq.data.tdata import Record
from cortiq.model import load_model
from cortiq.model.nll import score_records, text_windows
from cortiq.tokenizer import load_tokenizer

from model_helpers import _perturb_norms, save_hf, tiny_llama


@pytest.fixture
def llama(tmp_path):
    hf = tiny_llama()
    _perturb_norms(hf)
    return hf, convert_hf_dir(save_hf(hf, tmp_path / "hf"), tmp_path / "m.cmf")


def _hf_nll(hf, ids, first):
    with torch.no_grad():
        lg = hf(torch.tensor([list(ids)])).logits[0, :-1]
    ce = F.cross_entropy(lg, torch.tensor(list(ids[1:])), reduction="none")
    return float(ce[first - 1 :].sum()), len(ids) - first


def test_score_records_matches_transformers(llama):
    hf, path = llama
    m = load_model(path)
    rng = np.random.default_rng(0)
    recs = [Record(f"r{i}", "test", "c", rng.integers(0, 259, L).astype(np.uint32), first)
            for i, (L, first) in enumerate([(9, 3), (30, 1), (17, 17), (5, 2), (23, 10)])]
    for loss_on in ("answer", "all"):
        want_s = want_n = 0
        for r in recs:
            s, n = _hf_nll(hf, r.ids.astype(np.int64), max(r.first, 1) if loss_on == "answer" else 1)
            want_s, want_n = want_s + s, want_n + n
        got_s, got_n = score_records(m, recs, loss_on=loss_on, batch_tokens=40, chunk=7)
        assert got_n == want_n
        assert got_s == pytest.approx(want_s, rel=1e-5)


def test_text_windows():
    w = text_windows(list(range(11)), 4)
    assert [list(x.ids) for x in w] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10]]
    assert [list(x.ids) for x in text_windows(list(range(9)), 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_cli_nll_on_text_agrees_with_transformers(llama, tmp_path, capsys):
    hf, path = llama
    text = "The quick brown fox jumps over the lazy dog. " * 5
    (tmp_path / "t.txt").write_text(text)
    assert main(["nll", str(path), str(tmp_path / "t.txt"), "--window", "64", "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    ids = load_tokenizer(path).encode(text).ids
    s = n = 0
    for w in text_windows(ids, 64):
        a, b = _hf_nll(hf, list(w.ids), 1)
        s, n = s + a, n + b
    assert got["tokens"] == n
    assert got["nll"] == pytest.approx(s / n, rel=1e-5)
    assert got["ppl"] == pytest.approx(math.exp(s / n), rel=1e-5)


def test_cli_nll_bad_data_is_one_line(llama, tmp_path, capsys):
    _, path = llama
    assert main(["nll", str(path), str(tmp_path / "nope.txt")]) == 1
    assert capsys.readouterr().err.strip() == f"cortiq: {tmp_path / 'nope.txt'}: no such file or directory"


def test_cli_generate_streams_the_greedy_tokens(llama, capsys):
    _, path = llama
    from cortiq.model.generate import generate

    assert main(["generate", str(path), "Hello", "--max-new", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    tok = load_tokenizer(path)
    want = generate(load_model(path), tok.encode("Hello").ids, 8, eos_ids=[256]).tokens
    assert out == "Hello" + tok.decode(want, skip_special_tokens=True) + "\n"


def test_cli_generate_speculative_without_mtp(llama, capsys):
    _, path = llama
    assert main(["generate", str(path), "Hi", "--speculative", "--device", "cpu"]) == 1
    assert "has no MTP draft block" in capsys.readouterr().err


def test_cli_nll_on_tdata_agrees_with_transformers(llama, tmp_path, capsys):
    from cortiq.data import Tdata
    from cortiq.data.builder import build
    from cortiq.data.settings import BuildSettings

    hf, path = llama
    (tmp_path / "c.jsonl").write_text("\n".join(
        json.dumps({"prompt": f"Question {i}?", "answer": f"Answer number {i} is short.", "split": "test" if i % 2 else "train"}) for i in range(6)))
    td = build([str(tmp_path / "c.jsonl")], path, tmp_path / "td", BuildSettings())
    td = Tdata.open(getattr(td, "path", td))
    recs = td.records("test")
    assert recs and all(r.first > 1 for r in recs)
    # the answer tokens of each record, scored by transformers one record at a time
    scored = [_hf_nll(hf, r.ids.astype(np.int64), r.first) for r in recs]
    want_s, want_n = sum(s for s, _ in scored), sum(n for _, n in scored)
    assert main(["nll", str(path), str(td.path), "--split", "test", "--json", "--device", "cpu"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == want_n == sum(len(r.ids) - r.first for r in recs)
    assert got["nll"] == pytest.approx(want_s / want_n, rel=1e-5)
