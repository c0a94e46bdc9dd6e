"""The option every command that writes a model or a folder shares (store.check_output's rule)."""

from __future__ import annotations

FORCE_HELP = ("overwrite an existing output that this command would not replace by itself (a file that is not "
              "its kind of output, a directory of other things); an output that is an input is refused regardless")


def add_force(p) -> None:
    p.add_argument("--force", action="store_true", help=FORCE_HELP)
