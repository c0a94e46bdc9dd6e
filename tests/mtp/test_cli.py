"""`cortiq mtp init|heal` through the CLI: outputs, and bad input as one line, exit 1."""

import re

from cortiq.cli import main
from cortiq.cmf import open_cmf

from mtp_helpers import write_model


def test_cli_init_then_heal(tiny, tmp_path, capsys):
    _, data = tiny
    bare = write_model(tmp_path / "bare.cmf", mtp=False)
    # a model without a draft: pointed at `mtp init`
    rc = main(["mtp", "heal", str(bare), "--data", str(data), "--out", str(tmp_path / "x.cmf"), "--window", "32", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 1 and "cortiq: " in err and "mtp init" in err and "Traceback" not in err
    assert main(["mtp", "init", str(bare), "--out", str(tmp_path / "i.cmf")]) == 0
    assert open_cmf(tmp_path / "i.cmf").arch.mtp_layers == 1
    out = tmp_path / "h.cmf"
    rc = main(["mtp", "heal", str(tmp_path / "i.cmf"), "--data", str(data), "--out", str(out), "--window", "32",
               "--topk", "8", "--epochs", "0.5", "--eval-every", "5", "--lr", "1e-3", "--train-input", "--device", "cpu",
               "--gen-prompt", "8", "--batch", "2", "--gen-windows", "0",
               "--trunk-cache", str(tmp_path / "cache"), "--dump", str(tmp_path / "dump")])
    err = capsys.readouterr().err
    assert rc == 0, err
    block = open_cmf(out).provenance["mtp_heal"]
    assert block["settings"]["train_input"] is True
    # the line the command ends with reports what the written model records, and the best checkpoint
    # kept is never worse than the fresh draft (step 0 is a candidate)
    before, after = (float(x) for x in re.search(r"drafts a round ([\d.]+) -> ([\d.]+)", err).groups())
    assert (before, after) == (round(block["drafts_per_round_before"], 3), round(block["drafts_per_round_after"], 3))
    assert block["drafts_per_round_after"] >= block["drafts_per_round_before"]
    assert err.endswith(f"{out}: its tokens ranked for the draft (`serve --speculative --draft-vocab N`: the first N; "
                        "every token by default)\n")
    # the same command again goes through the cache the flows share: the trunk pass and the trained draft
    # are reused, nothing is trained, and the model written is the same file's content
    again = tmp_path / "h2.cmf"
    args = ["mtp", "heal", str(tmp_path / "i.cmf"), "--data", str(data), "--out", str(again), "--window", "32",
            "--topk", "8", "--epochs", "0.5", "--eval-every", "5", "--lr", "1e-3", "--train-input", "--device", "cpu",
            "--gen-prompt", "8", "--batch", "2", "--gen-windows", "0"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "trunk: reusing" in err and "mtp: reusing" in err and "hold per chain step" not in err
    assert again.read_bytes() == out.read_bytes()
    d = tmp_path / "dump"
    n, T, k = 40, 32, 8
    for name, size in [("len.u32", n * 4), ("ids.u32", n * T * 4), ("ti.u32", n * T * k * 4), ("tp.f32", n * T * k * 4),
                       ("embed.f16", 259 * 32 * 2), ("eh_proj.f16", 32 * 64 * 2), ("meta.json", None),
                       ("before/x1.f16", n * T * 32 * 2), ("before/d3.u32", n * T * 4 * 4), ("after/dp1.f32", n * T * 4 * 4)]:
        assert (d / name).exists(), name
        if size is not None:
            assert (d / name).stat().st_size == size, name


def test_cli_stride_shorter_than_chain(tiny, tmp_path, capsys):
    model, data = tiny
    rc = main(["mtp", "heal", str(model), "--data", str(data), "--out", str(tmp_path / "x.cmf"), "--stride", "2"])
    err = capsys.readouterr().err
    assert rc == 1 and err.strip() == "cortiq: mtp settings: stride 2 is shorter than the chain (3): chains laid out as rounds would overlap"
