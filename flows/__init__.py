"""Prefect flows: compress_and_heal (the whole pipeline) and its parts compress, heal, mtp_heal.

Importing this package sets the offline environment (no telemetry, PREFECT_HOME
under the cortiq home) before prefect is imported.
"""

import tasks as _tasks  # noqa: F401  (sets the environment)
