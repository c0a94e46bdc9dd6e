"""Fixtures of the MTP tests (helpers in mtp_helpers.py)."""

import pytest

from mtp_helpers import greedy_records, write_model, write_tdata


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """(model with draft, tdata of 40 greedy windows of 32: the trunk's own text)."""
    root = tmp_path_factory.mktemp("mtp")
    model = write_model(root / "m.cmf")
    data = write_tdata(root / "greedy.tdata", greedy_records(model, 40, 32))
    return model, data
