"""The commands that need the orchestrator (`cortiq run`, `cortiq demo`,
`cortiq compare`). They live with the flows, not in cortiq/, and reach the
`cortiq` command line through the `cortiq.commands` entry-point group
(pyproject.toml), so the core library never imports the orchestration side."""
