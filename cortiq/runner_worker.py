"""One rank of a stage that `cortiq.runner.run` relaunched under torchrun.

`python -m cortiq.runner_worker JOB.json`, started N times by torchrun, is
not a command for users: the job file (`cortiq.runner.write_job`) names the
stage (its module and name), the root, and the parameters as plain JSON (paths
as strings, the settings dataclass as its dict, built again by `Stage.params`:
the same settings, so the same digest). Nothing is pickled either way.

Each rank joins the process group and calls `runner.run` with the job's
parameters. Beside the job file:
- `log.jsonl`: what rank 0's stage logged (`tracking.JsonlLogger`), played
  into the caller's logger once the ranks are done;
- `result.json`: rank 0's outcome (digest, reused), written last;
- `error-R.txt`: rank R's error in one line, when it failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import dist, runner, store, tracking
from .errors import CortiqError
from .exit import finish


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not dist.under_torchrun():
        print("cortiq.runner_worker: runs one rank of a stage under torchrun (started by cortiq.runner.run)",
              file=sys.stderr)
        return 2
    path = Path(argv[0])
    d = path.parent
    try:
        stage, root, progress, params = runner.read_job(path)
        dist.init()
        logger = tracking.JsonlLogger(d / runner.LOG) if dist.is_main() else tracking.NULL
        r = runner.run(stage, root, logger, progress, **params)
        if dist.is_main():
            store.write_text(d / runner.RESULT, json.dumps({"digest": r["digest"], "reused": r["reused"]}))
    except CortiqError as e:
        # one line, said once by the caller (every rank may meet the same bad input)
        store.write_text(runner.error_file(d, dist.rank()), str(e))
        return 1
    except BaseException as e:
        # a bug, or a failure injected by a test: the traceback goes to stderr, its last line to the caller
        store.write_text(runner.error_file(d, dist.rank()), f"{type(e).__name__}: {e}".splitlines()[0])
        raise
    finally:
        dist.finish()
    return 0


if __name__ == "__main__":
    finish(main())
