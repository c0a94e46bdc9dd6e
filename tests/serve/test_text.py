"""Sampling, incremental text, chat templates: against plain references."""

import random
import subprocess
import sys

import pytest
import torch

from cortiq.chat import ChatTemplateError
from cortiq.serve.chat import chat_prompt
from cortiq.serve.detok import IncrementalText
from cortiq.serve.sampling import sample_ids, sample_ids_reference
from cortiq.tokenizer import byte_tokenizer_json


@pytest.fixture(scope="module")
def tok():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(byte_tokenizer_json())


@pytest.mark.parametrize("B,V", [(1, 7), (5, 37), (9, 259)])
def test_choose_equals_the_per_row_reference(B, V):
    g = torch.Generator().manual_seed(B * V)
    for trial in range(20):
        logits = torch.randn(B, V, generator=g) * 3
        rng = random.Random(trial)
        temp = [rng.choice([0.0, 0.3, 1.0, 1.7]) for _ in range(B)]
        top_p = [rng.choice([1.0, 0.9, 0.5, 0.05]) for _ in range(B)]
        u = [rng.random() for _ in range(B)]
        assert sample_ids(logits, temp, top_p, u).tolist() == sample_ids_reference(logits, temp, top_p, u)


def test_choose_follows_the_distribution():
    # u spread evenly over [0, 1) must land on each token in proportion to its probability
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2, 0.0]]))
    n = 1000
    got = [int(sample_ids(logits, [1.0], [1.0], [(i + 0.5) / n])[0]) for i in range(n)]
    assert [got.count(t) for t in range(4)] == [500, 300, 200, 0]
    # top-p 0.6 keeps tokens 0 and 1 (mass 0.8 once 0.5 is short of 0.6), renormalised to 5/8, 3/8
    got = [int(sample_ids(logits, [1.0], [0.6], [(i + 0.5) / n])[0]) for i in range(n)]
    assert [got.count(t) for t in range(4)] == [625, 375, 0, 0]


def _stream(tok, ids, stop=()):
    t = IncrementalText(tok, stop)
    pieces = [t.add(i) for i in ids]
    pieces.append(t.finish())
    return pieces, t


def test_incremental_text_equals_the_whole_decode(tok):
    rng = random.Random(0)
    utf8 = list("héllo wörld — ✓ 日本語 🎉".encode())
    for trial in range(200):
        # valid multi-byte text, random bytes (invalid UTF-8 included) and special tokens, mixed
        ids = [rng.choice([rng.choice(utf8), rng.randrange(256), rng.choice([256, 257, 258])])
               for _ in range(rng.randrange(1, 40))]
        pieces, _ = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)
    text = "héllo wörld ✓"
    ids = tok.encode(text).ids
    pieces, _ = _stream(tok, ids)
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_stop_strings_cut_and_hold_back(tok):
    ids = tok.encode("abc STOP def").ids
    pieces, t = _stream(tok, ids, stop=["STOP", "zz"])
    assert "".join(pieces) == "abc " and t.stopped
    # nothing of a stop string is ever sent, even its first letters
    assert all("S" not in p for p in pieces)
    # a partial match that does not complete is sent at the end
    pieces, t = _stream(tok, tok.encode("abc STO").ids, stop=["STOP"])
    assert "".join(pieces) == "abc STO" and not t.stopped
    # a stop string spanning a multi-byte character
    pieces, t = _stream(tok, tok.encode("x✓y").ids, stop=["✓"])
    assert "".join(pieces) == "x" and t.stopped


CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_prompt_and_its_sandbox():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert chat_prompt(CHATML, msgs) == ("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        chat_prompt(None, msgs)
    with pytest.raises(ChatTemplateError, match="refused the messages: no system"):
        chat_prompt("{{ raise_exception('no system') }}", msgs)
    with pytest.raises(ChatTemplateError, match="failed"):  # the sandbox refuses to mutate what it is given
        chat_prompt("{{ messages.append(1) }}", msgs)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        chat_prompt("{% for %}", msgs)
    with pytest.raises(ChatTemplateError, match="unsafe"):  # no way to Python's internals
        chat_prompt("{{ ''.__class__.__mro__ }}", msgs)


def test_importing_cortiq_and_its_serve_package_loads_no_fastapi():
    code = ("import sys, cortiq, cortiq.serve, cortiq.serve.settings; from cortiq.cli import build_parser; build_parser();"
            "print(','.join(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
