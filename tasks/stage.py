"""The one Prefect task: a stage of the pipeline run through cortiq's runner.

`stage_task(stage)` is a task named after the stage that calls
`cortiq.runner.run`; the runner's cache (the stage outputs, named by digest)
is the only cache, shared with the command line. A reused output puts the task
run in the Cached state. A stage whose settings say gpus > 1 runs as that many
processes under torchrun (the runner relaunches it and plays rank 0's metrics
into the task's logger). Prefect persists no result: its result records name
their own serializer, pickle included, so a file replaced under the cortiq
home would run code when read back; nothing under the home is unpickled.
"""

from __future__ import annotations

import functools

from cortiq import runner, tracking
from cortiq.runner import Stage


@functools.cache
def stage_task(stage: Stage):
    """The Prefect task of `stage`: (root, params, logger) -> the runner's result."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE
    from prefect.states import Completed

    @task(name=stage.name, description=stage.doc, persist_result=False, cache_policy=NO_CACHE)
    def run_stage(root: str, params: dict, logger=None):
        r = runner.run(stage, root, logger or tracking.NULL, **params)
        return Completed(name="Cached", data=r) if r["reused"] else r

    return run_stage
