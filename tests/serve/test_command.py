"""`cortiq serve` refuses bad input in one line, before it listens."""

import sys

import pytest

from cortiq.cli import main

from serve_helpers import arch, random_model


def test_missing_fastapi_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "fastapi", None)  # `import fastapi` now raises ImportError
    assert main(["serve", str(tmp_path / "m.cmf")]) == 1
    assert capsys.readouterr().err == "cortiq: cortiq serve needs FastAPI and uvicorn: pip install 'cortiq[serve]'\n"


def test_bad_model_and_settings_are_one_line(tmp_path, capsys):
    assert main(["serve", str(tmp_path / "nope.cmf")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("cortiq: ") and "nope.cmf" in err and err.count("\n") == 1
    assert main(["serve", str(tmp_path / "nope.cmf"), "--max-batch", "0"]) == 1
    assert capsys.readouterr().err == "cortiq: serve settings: max_batch 0 must be >= 1\n"


def test_speculative_needs_a_draft(tmp_path, capsys):
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    m = random_model(arch("llama", mtp=False))
    path = write_cmf(tmp_path / "nodraft.cmf", new_doc(m.arch, tokenizer_doc(byte_tokenizer_json(), [256])),
                     specs_from_tensors([(n, p.detach().clone()) for n, p in m.named_parameters()], "f32"))
    assert main(["serve", str(path), "--speculative", "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "has no MTP draft block" in err and err.count("\n") == 1


@pytest.mark.parametrize("port", ["-1", "70000"])
def test_port_range(tmp_path, capsys, port):
    assert main(["serve", str(tmp_path / "m.cmf"), "--port", port]) == 1
    assert capsys.readouterr().err == f"cortiq: serve settings: port {port} is outside [0, 65535]\n"


@pytest.mark.parametrize("draft,branches", [(0, 1), (3, 1), (3, 4)])
def test_the_kv_estimate_is_what_the_engine_allocates(draft, branches):
    # serve refuses a cache larger than the device's free memory by this estimate, before allocating
    import torch

    from cortiq.commands.serve import kv_bytes
    from cortiq.serve.engine import DecodeAdapter

    m = random_model(arch("llama"))
    eng = DecodeAdapter(m, 3, 50, draft=draft, branches=branches).eng
    caches = [eng.k_cache, eng.v_cache] + ([eng.mtp_k_cache, eng.mtp_v_cache] if draft else [])
    assert kv_bytes(m.arch, 3, 50, draft, torch.float32, branches) == sum(c.numel() * c.element_size() for c in caches)


def test_draft_branches_auto_is_a_tree_where_one_runs():
    import torch

    from cortiq.serve.settings import ServeSettings

    attn, mixed = arch(), arch("hybrid")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    spec = ServeSettings(speculative=True)
    assert (spec.draft, spec.draft_branches) == (3, 0)
    assert spec.branches(attn, cuda) == 4
    assert spec.branches(attn, cpu) == 1  # (a CPU's verify rows cost compute: the chain)
    assert spec.branches(mixed, cuda) == 1  # a Gated DeltaNet state holds one branch
    assert ServeSettings(speculative=True, engine="loop").branches(attn, cuda) == 1
    assert ServeSettings(speculative=True, draft_branches=3).branches(attn, cpu) == 3
    assert ServeSettings(draft_branches=3).branches(attn, cuda) == 1  # no --speculative: no draft at all
