"""The tokenizer a CMF file carries: the `tokenizer.json` text plus special and EOS ids."""

from __future__ import annotations

import json
import os

from .errors import CortiqError


def tokenizer_doc(
    tokenizer_json: str,
    eos_ids: list[int],
    bos_id: int | None = None,
    chat_template: str | None = None,
    special_ids: list[int] | None = None,
    where: str = "tokenizer.json",
) -> dict:
    """The `tokenizer` entry of a CMF document."""
    if special_ids is None:
        try:
            added = json.loads(tokenizer_json).get("added_tokens") or []
            special_ids = sorted(int(t["id"]) for t in added if t.get("special"))
        except (json.JSONDecodeError, RecursionError):
            raise CortiqError(f"{where}: not JSON") from None
        except (AttributeError, KeyError, TypeError, ValueError):
            raise CortiqError(f"{where}: added_tokens is not a list of {{id, special}} entries") from None
    return {
        "json": tokenizer_json,
        "eos_ids": [int(i) for i in eos_ids],
        "bos_id": None if bos_id is None else int(bos_id),
        "special_ids": [int(i) for i in special_ids],
        "chat_template": chat_template,
    }


def from_doc(doc: dict | None, where: str = "model"):
    """A `tokenizers.Tokenizer` from a CMF tokenizer entry."""
    from tokenizers import Tokenizer

    if not doc or not doc.get("json"):
        raise CortiqError(f"{where}: carries no tokenizer (convert it from a source that has tokenizer.json)")
    try:
        return Tokenizer.from_str(doc["json"])
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises a bare Exception)
        raise CortiqError(f"{where}: its tokenizer does not load ({' '.join(str(e).split())[:200]})") from None


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer inside a CMF file, as a `tokenizers.Tokenizer`."""
    from .cmf import open_cmf

    f = open_cmf(path)
    return from_doc(f.tokenizer, str(path))


def byte_tokenizer_json(specials: tuple[str, ...] = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")) -> str:
    """A tiny byte-level BPE tokenizer (256 byte tokens, no merges, then the
    specials): every text round-trips. Tests and tiny models use it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(specials))
    return tok.to_str()
