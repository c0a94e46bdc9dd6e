"""A fork server for the fuzz suite: imports cortiq (and torch) once, then runs each
case — a `cortiq` command line — in a forked child with an address-space cap and a
timeout, its stdout and stderr captured. One JSON case per stdin line, one JSON
result per stdout line.

A fresh interpreter per case would spend a second or two importing torch; a fork
starts in milliseconds and is just as isolated (its own memory, limits and exit).
The parent never runs a torch operation, so no thread pool exists to be broken by
the fork.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile
import time
import traceback


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _run(case: dict) -> dict:
    out = tempfile.TemporaryFile()
    err = tempfile.TemporaryFile()
    base = _vm_size()
    sys.stdout.flush()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the child: capped, chdir'd, output redirected, then the command line
        rc = 99
        try:
            cap = base + int(case["mem"])
            resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
            os.chdir(case["cwd"])
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            from cortiq.cli import main

            rc = main(case["argv"])
        except SystemExit as e:  # argparse
            rc = e.code if isinstance(e.code, int) else 2
        except BaseException:  # noqa: BLE001 (reported to the test as a traceback)
            traceback.print_exc()
            rc = 99
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    timed_out = False
    while True:
        wpid, status, ru = os.wait4(pid, os.WNOHANG)
        if wpid:
            break
        if time.monotonic() - t0 > case["timeout"]:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
            wpid, status, ru = os.wait4(pid, 0)
            break
        time.sleep(0.002)
    secs = time.monotonic() - t0
    out.seek(0)
    err.seek(0)
    rc = os.waitstatus_to_exitcode(status)
    return {"rc": rc, "timed_out": timed_out, "secs": secs, "cpu": ru.ru_utime + ru.ru_stime, "maxrss": ru.ru_maxrss * 1024,
            "stdout": out.read().decode("utf-8", "replace"), "stderr": err.read().decode("utf-8", "replace")}


def main():
    # what the commands import, imported once here so each child starts warm
    import torch  # noqa: F401

    import cortiq.cli  # noqa: F401
    import cortiq.commands.generate  # noqa: F401
    import cortiq.commands.nll  # noqa: F401
    import cortiq.convert.hf  # noqa: F401
    import cortiq.model  # noqa: F401
    import jinja2.sandbox  # noqa: F401
    import safetensors.torch  # noqa: F401
    import tokenizers  # noqa: F401
    import tqdm  # noqa: F401

    # building a model on the meta device imports torch._dynamo (seconds): once, here. Meta
    # tensors run no kernels, so no thread pool starts before the forks.
    from cortiq.model.decoder import CausalLM
    from fuzz_gen import ARCH

    with torch.device("meta"):
        CausalLM(ARCH)

    print(json.dumps({"ready": True, "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), flush=True)
    for line in sys.stdin:
        print(json.dumps(_run(json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
