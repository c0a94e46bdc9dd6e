"""The Prefect test harness once per session, results in a temp dir; a tiny model and corpus."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

# before tasks/ or flows/ are imported (they default PREFECT_HOME to the cortiq home)
os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="cortiq-prefect-home-"))

from tiny import V, llama_arch, write_corpus, write_random  # noqa: E402,F401


@pytest.fixture(scope="session", autouse=True)
def prefect_harness(tmp_path_factory):
    storage = tmp_path_factory.mktemp("prefect-storage")
    os.environ["PREFECT_LOCAL_STORAGE_PATH"] = str(storage)
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180), temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite store, its tables made and migrated once for the session."""
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(autouse=True)
def _flows_home(_cortiq_home, _mlflow_template, monkeypatch):
    """Each test's cortiq home starts with a copy of the empty MLflow store: a fresh store
    builds its tables by running every one of MLflow's migrations (measured: 2.2 s of CPU, 8 s
    of wall beside other work on 2 cores; a copy takes 0.1 s), in every test that tracks a run. A fresh store made
    by MLflow itself is still what the tests of `cortiq run`, `make serve` and the
    deployment get, in homes of their own.

    Torch on one thread: the tiny models' matrices take microseconds, and two OpenMP threads
    on 2 cores shared with the Prefect server, workers and ranks make each op wait on a
    thread that is not running (measured: a 32x64 linear 20 us on one thread, 6 ms on two
    beside other processes). The subprocesses the tests start inherit it."""
    import torch

    from cortiq import store

    home = store.home()
    home.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_mlflow_template, home / "mlflow.db")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield
    torch.set_num_threads(threads)


def tiny_cmf(path: Path, seed: int = 0, hidden: int = 32, width: int = 64, layers: int = 2) -> Path:
    """A random Llama-style CMF model with the byte tokenizer (EOS 256)."""
    return write_random(path, llama_arch(hidden, width, layers), seed)


def tiny_corpus(path: Path, n_docs: int = 24) -> Path:
    return write_corpus(path, n_docs)


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
            # no retain data (the default, pydoc, would double every stage's windows); the tests of the
            # retain mix name their own
            "retain": {"sources": []},
            "compress": {"keep_frac": 0.5,
                         "masks": {"max_steps": 4, "window": 32, "batch": 2, "val_windows": 2, "eval_every": 2}},
            # the tiny source is a random model: distilling it alone leaves the best held-out checkpoint
            # at step 0 (healed == pruned, so the two scores share a digest); the data's token makes heal move
            "heal": {"epochs": 1.0, "window": 32, "batch": 2, "eval_every": 2, "checkpoint_every": 2, "topk": 8,
                     "lr": 1e-3, "target": "topk", "ce": 0.3},
            "mtp": {"window": 32, "tokens": 4096, "topk": 4, "epochs": 1.0, "batch": 2, "eval_every": 2, "refresh": 4,
                    "chain": 2, "gen_windows": 0},
            "codecs": ["q8"],
            # q8 by AWQ (its default is round-to-nearest), so the flows' Grams-and-blocks stages run
            "quant": {"window": 32, "max_windows": 8, "method_8bit": "awq"},
            "score_window": 32,
        }

    return make
