"""cortiq.dist in a rank of a gloo group: the group's threads end at
dist.finish even where torch binds the group into a module it imports late
(tests/ranks.py checks the threads after each rank's finish)."""

import sys

from ranks import run_ranks


def _late_import(rank):
    # torch.distributed.nn.functional takes the world group as its functions' default argument when
    # imported while the group exists; in a rank it comes in late, through torch._dynamo (FSDP's
    # modules), on the first torch.nn.init under a device context or torch.compile. This module
    # imports no torch, so only cortiq.dist.init can have imported it before the group formed.
    assert "torch._dynamo" not in sys.modules
    import torch.distributed.nn.functional as fn

    assert fn.all_reduce.__defaults__[-1] is None  # no group bound: the default group, looked up per call


def test_a_module_that_binds_the_group_does_not_keep_it_past_finish(tmp_path):
    run_ranks(_late_import, 1, tmp=tmp_path)  # one rank: the same threads as two, in one interpreter
