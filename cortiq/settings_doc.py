"""docs/settings.md, generated from the settings dataclasses' metadata.

    python -m cortiq.settings_doc > docs/settings.md

A test checks that the committed file is what this prints, so the table cannot
drift from the settings it documents.
"""

from __future__ import annotations

import importlib

from .settings import EXTRA_HELP, EXTRA_KEYS, STAGE_SETTINGS, PipelineSettings, stage_settings_class
from .settings_meta import table

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
           table(PipelineSettings, options=False, skip=tuple(STAGE_SETTINGS))]
    for group in STAGE_SETTINGS:
        cls = stage_settings_class(group)
        out.append(f"### `{group}`: `{STAGE_COMMANDS[group]}`\n")
        for key, default in EXTRA_KEYS.get(group, {}).items():
            out.append(f"`{group}.{key}` (default `[{', '.join(default)}]`): {EXTRA_HELP[f'{group}.{key}']}.\n")
        out.append(table(cls, f"{group}."))
    out.append("## Commands\n")
    for command, (mod, name) in COMMAND_SETTINGS.items():
        out.append(f"### `{command}`\n")
        out.append(table(getattr(importlib.import_module(mod), name)))
    return "\n".join(out)


if __name__ == "__main__":
    print(settings_doc(), end="")
