"""The Prefect test harness once per session, results in a temp dir; a tiny model and corpus."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# before tasks/ or flows/ are imported (they default PREFECT_HOME to the cortiq home)
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="cortiq-prefect-home-"))


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    storage = tmp_path_factory.mktemp("prefect-storage")
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(storage)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


V = 259


def tiny_cmf(path: Path, seed: int = 0, hidden: int = 32, width: int = 64, layers: int = 2) -> Path:
    """A random Llama-style CMF model with the byte tokenizer (EOS 256)."""
    import torch

    from cortiq.arch import Arch
    from cortiq.cmf import new_doc, specs_from_tensors, write_cmf
    from cortiq.model import CausalLM
    from cortiq.tokenizer import byte_tokenizer_json, tokenizer_doc

    torch.manual_seed(seed)
    arch = Arch(arch_name="llama", vocab_size=V, hidden_size=hidden, num_layers=layers,
                intermediate_sizes=[width] * layers, num_heads=4, num_kv_heads=2, head_dim=hidden // 4,
                rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=512)
    model = CausalLM(arch)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (0.5 / p.shape[-1] ** 0.5 if "embed" not in n else 1.0))
    doc = new_doc(arch, tokenizer_doc(byte_tokenizer_json(), [256]))
    return write_cmf(path, doc, specs_from_tensors([(n, p.detach().clone()) for n, p in model.named_parameters()]))


TEXT = ("The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
        "How vexingly quick daft zebras jump! Sphinx of black quartz, judge my vow. ")


def tiny_corpus(path: Path, n_docs: int = 24) -> Path:
    path.write_text("\n\n".join(f"{i}: " + TEXT * (1 + i % 3) for i in range(n_docs)))
    return path


@pytest.fixture
def tiny(tmp_path) -> dict:
    """A tiny model and corpus, with the settings groups that keep every stage to seconds."""
    model = tiny_cmf(tmp_path / "tiny.cmf")
    corpus = tiny_corpus(tmp_path / "corpus.txt")
    return {"model": str(model), "corpus": str(corpus), "dir": tmp_path}


@pytest.fixture
def tiny_params():
    """Parameters that keep every stage of compress-and-heal to seconds on the tiny model."""

    def make(tiny) -> dict:
        return {
            "name": "tiny",
            "source": tiny["model"],
            "data": {"sources": [tiny["corpus"]], "record_tokens": 64, "fractions": [0.6, 0.2, 0.2]},
            "compress": {"masks": {"max_steps": 4, "window": 32, "batch": 2, "val_windows": 2, "eval_every": 2,
                                   "keep_frac": 0.5},
                         "fold": {"keep_frac": 0.5}},
            "heal": {"epochs": 1.0, "window": 32, "batch": 2, "eval_every": 2, "checkpoint_every": 2, "topk": 8,
                     "lr": 1e-3},
            "mtp": {"window": 32, "tokens": 4096, "topk": 4, "epochs": 1.0, "batch": 2, "eval_every": 2, "refresh": 4,
                    "chain": 2},
            "codecs": ["q8"],
            "score_window": 32,
        }

    return make
