"""--generate-with: the answers are the model's own greedy text."""

import json


import pytest

from cortiq.data import BuildSettings, build
from cortiq.errors import CortiqError
from cortiq.model import load_model
from cortiq.model.generate import generate
from cortiq.tokenizer import byte_tokenizer_json, load_tokenizer

from data_helpers import EOS, tiny_cmf, tiny_model_cmf


def test_generated_answers_are_the_models_greedy_text(tmp_path):
    model_cmf = tiny_model_cmf(tmp_path / "m.cmf")
    src = tmp_path / "p.jsonl"
    prompts = ["Hello, ", "The capital of France is", "x"]
    src.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": p, "answer": "ignored", "split": "train"})
                             for i, p in enumerate(prompts)) + "\n")
    td = build([str(src)], model_cmf, tmp_path / "td", BuildSettings(generate_with=str(model_cmf), max_new=12), device="cpu")
    tok = load_tokenizer(model_cmf)
    model = load_model(model_cmf)
    recs = {r.rid: r for r in td.records("train")}
    for i, p in enumerate(prompts):
        r = recs[f"p{i}"]
        ids = tok.encode(p, add_special_tokens=False).ids
        want = generate(model, ids, max_new=12, eos_ids=[EOS]).tokens
        want = want[:-1] if want and want[-1] == EOS else want
        assert r.first == len(ids) and r.ids[:r.first].tolist() == ids
        assert tok.decode(r.ids[r.first:-1].tolist(), skip_special_tokens=False) == tok.decode(want, skip_special_tokens=False)
        assert "ignored" not in tok.decode(r.ids.tolist())


def test_a_generator_with_another_tokenizer_is_refused(tmp_path):
    model_cmf = tiny_model_cmf(tmp_path / "m.cmf")
    other = tiny_cmf(tmp_path / "other.cmf", tok_json=byte_tokenizer_json(("<|eot|>", "<|a|>", "<|b|>")))
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"prompt": "hi", "split": "train"}) + "\n")
    with pytest.raises(CortiqError, match=r"m\.cmf: its tokenizer differs from the --tokenizer model .*other\.cmf"):
        build([str(src)], other, tmp_path / "td", BuildSettings(generate_with=str(model_cmf)), device="cpu")
