"""Prefect tasks: one thin adapter around cortiq's stage runner (tasks.stage).

The task of a stage takes the root and the stage's parameters as JSON values
(cortiq.runner.json_params), runs the stage through cortiq.runner.run, which
reuses a complete output (the task run is then Cached) or makes it, and
returns the digest, the output path and the stage's report. No task result is
persisted by Prefect: the outputs are the cache.
"""

import os as _os
import sys as _sys

from cortiq.store import home as _home

# offline and quiet before prefect is first imported (its settings are read then);
# MLflow reads DO_NOT_TRACK only as the word true
for _k, _v in (("DO_NOT_TRACK", "true"), ("PREFECT_SERVER_ANALYTICS_ENABLED", "false"),
               ("MLFLOW_DISABLE_TELEMETRY", "true"), ("PREFECT_HOME", str(_home() / "prefect")),
               # the embedded server starts in ~6-9 s alone, far slower on 2 busy cores
               ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")):
    _os.environ.setdefault(_k, _v)


class _HomeBeforePrefect:
    """Makes PREFECT_HOME as prefect is first imported: prefect creates its home without parents (a fresh
    machine has no cortiq home yet), and importing this package alone must write nothing (`cortiq run`
    is found through `flows`, and a bad parameter file is refused before any flow is imported)."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == "prefect":
            _os.makedirs(_os.environ["PREFECT_HOME"], exist_ok=True)
            _sys.meta_path.remove(_HomeBeforePrefect)
        return None  # the import itself is the next finder's


if "prefect" in _sys.modules:
    _os.makedirs(_os.environ["PREFECT_HOME"], exist_ok=True)
elif _HomeBeforePrefect not in _sys.meta_path:
    _sys.meta_path.insert(0, _HomeBeforePrefect)
