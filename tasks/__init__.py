"""Prefect tasks: one thin adapter around cortiq's stage runner (tasks.stage).

The task of a stage takes the root and the stage's parameters as JSON values
(cortiq.runner.json_params), runs the stage through cortiq.runner.run, which
reuses a complete output (the task run is then Cached) or makes it, and
returns the digest, the output path and the stage's report. No task result is
persisted by Prefect: the outputs are the cache.
"""

import os as _os

from cortiq.store import home as _home

# offline and quiet before prefect is first imported (its settings are read then);
# MLflow reads DO_NOT_TRACK only as the word true
for _k, _v in (("DO_NOT_TRACK", "true"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
               ("MLFLOW_DISABLE_TELEMETRY", "true"), ("PREFECT_HOME", str(_home() / "prefect")),
               # the embedded server starts in ~6-9 s alone, far slower on 2 busy cores
               ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")):
    _os.environ.setdefault(_k, _v)

# prefect creates its home without parents: a fresh machine has no cortiq home yet
_os.makedirs(_os.environ["PREFECT_HOME"], exist_ok=True)
