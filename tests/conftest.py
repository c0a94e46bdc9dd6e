"""Shared test set-up: quiet, offline tools, and temp homes."""

import os

os.environ.setdefault("DO_NOT_TRACK", "true")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _cortiq_home(tmp_path, monkeypatch):
    monkeypatch.setenv("CORTIQ_HOME", str(tmp_path / "cortiq-home"))
