"""The fact-recall probe: batched scores against a plain one-fact-at-a-time reference, what
"known" means, the report's arithmetic, the bundled set and its guards, the command."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from cortiq.errors import CortiqError
from cortiq.facts import FactScores, compare, encode_facts, kept_line, load_facts, score_facts
from cortiq.facts.probe import Encoded, Fact, bundled_facts, holds_probe_fact, part_of, probe_prompts, read_facts
from cortiq.model import load_model
from cortiq.tokenizer import load_tokenizer

from tiny import llama_arch, write_random


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_random(tmp_path_factory.mktemp("facts") / "m.cmf", llama_arch(layers=2), seed=5)


def _facts(n=13, seed=0):
    g = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "x", "epsilon zeta", "q"]
    return [Fact("k", " ".join(g.choice(words, size=int(g.integers(1, 6)))) + f" {i}",
                 " ".join(g.choice(words, size=int(g.integers(1, 3))))) for i in range(n)]


def _reference(model, enc: Encoded):
    """One fact at a time, the full logits of its whole sequence: the plain computation."""
    known, lp, first = [], [], []
    starts = np.concatenate([[0], np.cumsum(enc.lengths)])
    for i in range(len(enc.prompt_len)):
        ids = torch.from_numpy(enc.ids[starts[i] : starts[i + 1]])[None]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0].float(), -1)  # [T, V]
        p, a = int(enc.prompt_len[i]), int(enc.answer_len[i])
        rows, tgt = logp[p - 1 : p + a - 1], ids[0, p : p + a]
        known.append(bool((rows.argmax(-1) == tgt).all()))
        lp.append(float(rows.gather(1, tgt[:, None]).sum()))
        first.append(int(rows[0].argmax()))
    return np.array(known), np.array(lp), np.array(first)


@pytest.mark.parametrize("batch_tokens", [16, 37, 100_000])
def test_batched_scores_equal_one_fact_at_a_time(tiny, batch_tokens):
    """Chunks of every size (one fact a forward, a few, all at once): the same known flags,
    answer log-probs and first top tokens as the plain per-fact computation."""
    m = load_model(tiny)
    enc = encode_facts(_facts(), load_tokenizer(tiny))
    got = score_facts(m, enc, batch_tokens=batch_tokens, pad_id=7, head_rows=5)
    k, lp, first = _reference(m, enc)
    np.testing.assert_array_equal(got.known, k)
    np.testing.assert_allclose(got.logprob, lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got.first_top, first)


def test_known_means_the_whole_answer_is_greedy(tiny):
    """An answer made of the model's own greedy tokens is known; change its last token and it is not
    (its first token still the top-1: the first token alone does not make a fact known)."""
    from cortiq.model.generate import generate

    m = load_model(tiny)
    prompt = [72, 105, 33, 10]
    greedy = generate(m, prompt, max_new=3).tokens
    wrong = greedy[:2] + [(greedy[2] + 1) % 256]
    ids = np.array(prompt + greedy + prompt + wrong, dtype=np.int64)
    enc = Encoded(ids, np.array([4, 4]), np.array([3, 3]))
    s = score_facts(m, enc)
    assert s.known.tolist() == [True, False]
    assert s.first_top.tolist() == [greedy[0], greedy[0]]
    assert s.logprob[0] > s.logprob[1]


def test_compare_counts_the_sources_facts_kept():
    src = FactScores(np.array([1, 1, 1, 0, 1], bool), np.array([-1.0, -2.0, -0.5, -4.0, -1.0]), np.zeros(5, int))
    mod = FactScores(np.array([1, 0, 1, 1, 0], bool), np.array([-1.5, -3.0, -0.5, -1.0, -2.0]), np.zeros(5, int))
    c = compare(mod, src)
    # of the source's 4 facts the model keeps 2; its log-probs moved -0.5, -1, 0, -1 on them; the source is
    # sure (answer p >= 0.5, log-prob >= -0.693) of the third alone, which the model keeps
    assert c == {"facts": 5, "known": 3, "source_known": 4, "kept": 2, "kept_share": 0.5,
                 "mean_logprob_change": pytest.approx(-0.625), "source_sure": 1, "sure_kept": 1, "sure_kept_share": 1.0}
    assert kept_line("m", c) == ("m: facts kept 2 of the source's 4 (50.0 %), knows 3 of 5, mean change of the "
                                 "answer's log-prob -0.62; of the 1 the source is sure of (answer p >= 0.5): 1 (100.0 %)")
    assert compare(mod, None) == {"facts": 5, "known": 3}


def test_bundled_set_is_large_varied_and_split_in_two():
    facts = bundled_facts()
    assert len(facts) >= 300 and len({f.kind for f in facts}) >= 10
    dev, held = load_facts("dev"), load_facts("held")
    assert len(dev) + len(held) == len(facts) and min(len(dev), len(held)) >= 0.4 * len(facts)
    assert {f.prompt for f in held}.isdisjoint(f.prompt for f in dev)
    # the part is the prompt's alone: a fact keeps its part whatever else the file holds
    assert all(part_of(f.prompt) == f.part for f in facts)


def test_malformed_fact_files_are_one_clear_error(tmp_path):
    p = tmp_path / "f.tsv"
    p.write_text("# c\ncapital\tThe capital of X is\tY\nbad line\n")
    with pytest.raises(CortiqError, match=r"f.tsv:3: a fact is three tab-separated fields"):
        read_facts(p)
    p.write_text("a\tP one\tA\nb\tP one\tB\n")
    with pytest.raises(CortiqError, match=r"f.tsv:2: the prompt 'P one' is given twice \(first on line 1\)"):
        read_facts(p)
    with pytest.raises(CortiqError, match="unknown part 'x'"):
        load_facts("x")


def test_no_bundled_training_text_holds_a_probe_fact():
    """The probe is for evaluation only: the corpora a retain source or the data stage bundles and
    the self source's requests hold none of its prompts (normalised), and the guard finds one."""
    from cortiq.data.selfgen import REQUESTS
    from cortiq.data.sources import CORPORA, corpus_documents

    prompts = probe_prompts()
    texts = {"requests": "\n".join(REQUESTS)}
    for name in CORPORA:
        try:
            texts[name] = "\n".join(d.text for d in corpus_documents(name))
        except CortiqError:  # a corpus not installed here trains nothing here
            continue
    for name, t in texts.items():
        assert not holds_probe_fact(t, prompts), name
    assert holds_probe_fact("Well.  the CAPITAL of  France is nice", prompts)


def test_facts_command(tiny, tmp_path):
    f = tmp_path / "f.tsv"
    f.write_text("".join(f"{x.kind}\t{x.prompt}\t{x.answer}\n" for x in _facts(9)))
    run = [sys.executable, "-m", "cortiq", "facts", str(tiny), "--facts", str(f), "--part", "all", "--device", "cpu"]
    r = subprocess.run(run + ["--against", str(tiny), "--json"], capture_output=True, text=True, check=True)
    out = json.loads(r.stdout)
    assert out["facts"] == 9 and out["kept"] == out["source_known"] == out["known"]
    assert out["mean_logprob_change"] in (0.0, None)
    bad = subprocess.run(run[:5] + ["--facts", str(tmp_path / "missing.tsv")], capture_output=True, text=True)
    assert bad.returncode == 1 and bad.stderr.startswith("cortiq: ") and "missing.tsv: cannot read facts" in bad.stderr
    assert "Traceback" not in bad.stderr
