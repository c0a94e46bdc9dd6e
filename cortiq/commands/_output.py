"""The option every command that writes a model or a folder shares (store.check_output's rule)."""

from __future__ import annotations

FORCE_HELP = ("overwrite an existing output that this command would not replace by itself (a file that is not "
              "its kind of output, a directory of other things); an output that is an input is refused regardless")


def add_force(p) -> None:
    p.add_argument("--force", action="store_true", help=FORCE_HELP)


def add_stage_io(p, out_help: str, work_help: str) -> None:
    """--data, --out, --work and --force: the options of a command that runs cached stages on a tdata
    directory and writes a model (compress, heal)."""
    p.add_argument("--data", required=True, help="a tdata directory (cortiq data build)")
    p.add_argument("--out", required=True, help=out_help)
    p.add_argument("--work", default=None, help=work_help)
    add_force(p)


def add_model_io(p, src_metavar: str, src_help: str) -> None:
    """SRC and OUT.cmf, and --force: a command that reads one model and writes it as a CMF file
    (convert, recode)."""
    p.add_argument("src", metavar=src_metavar, help=src_help)
    p.add_argument("out", metavar="OUT.cmf", help="the CMF file to write")
    add_force(p)
