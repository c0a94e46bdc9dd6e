"""docs/settings.md, generated from the settings dataclasses' metadata.

    python -m cortiq.settings_doc > docs/settings.md

A test checks that the committed file is what this prints, so the table cannot
drift from the settings it documents.
"""

from __future__ import annotations

import dataclasses
import importlib

from .settings import PipelineSettings, groups
from .settings_meta import default_of, table

#: stage group -> the command whose options are that group's settings
STAGE_COMMANDS = {"data": "cortiq data build", "compress": "cortiq compress", "heal": "cortiq heal",
                  "mtp": "cortiq mtp heal", "retain": "cortiq compress --retain-*, cortiq heal --retain-*",
                  "quant": "cortiq recode --data"}

#: commands with settings of their own (not a parameter file's): command -> (module, dataclass)
COMMAND_SETTINGS = {
    "cortiq data self": ("cortiq.data.settings", "SelfGenSettings"),
    "cortiq generate": ("cortiq.commands.generate", "GenerateSettings"),
    "cortiq nll": ("cortiq.commands.nll", "NllSettings"),
    "cortiq facts": ("cortiq.commands.facts", "FactsSettings"),
    "cortiq export": ("cortiq.commands.export", "ExportSettings"),
    "cortiq serve": ("cortiq.serve.settings", "ServeSettings"),
}

HEAD = """# Settings

Every setting cortiq takes, generated from the settings dataclasses, where each
field carries its help, choices and bounds (`python -m cortiq.settings_doc >
docs/settings.md`; a test checks that this file is what that prints). The same
metadata makes every command's options and checks every parameter file's keys
and values. *allowed* is an interval (`[` and `]` include the end, `(` and `)`
do not) or the choices.
"""


def settings_doc() -> str:
    out = [HEAD, "## Parameter files\n",
           "A parameter file (`deployments/params/*.yaml`, `cortiq run --params`) sets these keys; a key it "
           "leaves out keeps the default. The *option* column names the same setting on the stage's own "
           "command.\n",
           "### The pipeline\n",
           table(PipelineSettings, options=False, skip=tuple(STAGE_COMMANDS))]
    for group, cls in groups().items():
        if group not in STAGE_COMMANDS:
            continue
        out.append(f"### `{group}`: `{STAGE_COMMANDS[group]}`\n")
        # a group's keys beyond its stage command's settings (data.sources): a line each above the table
        base = next((b for b in cls.__mro__[1:] if dataclasses.is_dataclass(b)), None)
        own = {f.name for f in dataclasses.fields(base)} if base is not None else set()
        for f in dataclasses.fields(cls):
            if base is not None and f.name not in own:
                out.append(f"`{group}.{f.name}` (default `[{', '.join(default_of(f))}]`): {f.metadata['help']}.\n")
        out.append(table(base or cls, f"{group}."))
    out.append("## Commands\n")
    for command, (mod, name) in COMMAND_SETTINGS.items():
        out.append(f"### `{command}`\n")
        out.append(table(getattr(importlib.import_module(mod), name)))
    return "\n".join(out)


if __name__ == "__main__":
    print(settings_doc(), end="")
