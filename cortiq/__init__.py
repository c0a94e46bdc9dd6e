"""cortiq: make language models smaller and heal them back.

The core library: formats, model, data and algorithms. It imports neither
prefect nor mlflow (the orchestration lives in `tasks/` and `flows/`).
"""

__version__ = "0.1.0"

from .errors import CortiqError  # noqa: E402


def load_tokenizer(path):
    """The tokenizer inside a CMF file, as a `tokenizers.Tokenizer`."""
    from .tokenizer import load_tokenizer as _load

    return _load(path)


def __getattr__(name):
    # heavy pieces import on first use, so `import cortiq` stays cheap
    if name == "load_model":
        from .model import load_model

        return load_model
    raise AttributeError(name)


__all__ = ["CortiqError", "load_model", "load_tokenizer", "__version__"]
