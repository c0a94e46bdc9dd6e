"""bench.quality.knowledge's soup rows: healed models averaged weight by weight."""

import torch

from bench.quality.knowledge import ROWS, average
from cortiq.model import load_model
from tiny import llama_arch, write_random


def test_the_average_of_two_models_is_their_mean_weight_by_weight(tmp_path):
    a = llama_arch(hidden=24, width=40, layers=3)
    paths = [write_random(tmp_path / f"m{i}.cmf", a, seed=i) for i in range(2)]
    got = load_model(average(paths, tmp_path / "soup.cmf"))
    one, two = (dict(load_model(p).named_parameters()) for p in paths)
    for n, p in got.named_parameters():
        torch.testing.assert_close(p, (one[n] + two[n]) / 2, msg=n)
        assert not torch.equal(one[n], two[n]), n  # an average, not a copy of either


def test_a_soup_row_names_rows_of_one_pruned_model():
    def pruning(r):  # what the pruned model depends on: the members differ in their heal alone
        return (r.sources, r.share, r.scope, r.floor, r.lists, r.entities, r.objective, r.keep, r.l1, r.mask_sources,
                r.repair, r.weights, r.learn, r.path, r.gram_windows)

    soups = {label: row.soup for label, row in ROWS.items() if row.soup}
    assert soups
    for label, members in soups.items():
        assert len({pruning(ROWS[m]) for m in members}) == 1 and not any(ROWS[m].soup for m in members), label
