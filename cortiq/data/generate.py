"""Answers written by a model (self-distillation data: the teacher's own text).

Every prompt is decoded greedily by the one generator of the model's own text
(cortiq.data.selfgen.generate_rows: all prompts in one continuously refilled
batch on the static-cache decode engine); its answer replaces whatever answer
the source gave.
"""

from __future__ import annotations

import os
from typing import Callable

from ..errors import CortiqError
from .sources import Item
from .tdata import tokenizer_digest


def generate_answers(items: list[Item], model_path: str | os.PathLike, tokenizer_cmf, max_new: int,
                     device: str | None = None, progress: Callable[[str], None] | None = None) -> int:
    """Fill in the answer of every prompt and chat in `items` (in place) from `model_path`;
    returns how many were answered. The model must share `tokenizer_cmf`'s tokenizer."""
    from ..cmf import open_cmf
    from ..devices import resolve_compute, resolve_device
    from ..model import load_model
    from ..tokenizer import from_doc
    from .chats import chat_parts
    from .selfgen import DEFAULT_SLOTS, generate_rows

    todo = [it for it in items if it.kind in ("pair", "chat")]
    if not todo:
        return 0
    mf = open_cmf(model_path)
    tdoc, mdoc = tokenizer_cmf.tokenizer or {}, mf.tokenizer or {}
    if not mdoc.get("json") or tokenizer_digest(mdoc["json"]) != tokenizer_digest(tdoc.get("json", "")):
        raise CortiqError(f"{model_path}: its tokenizer differs from the --tokenizer model {tokenizer_cmf.path}'s "
                          f"(generated answers must be in the data's tokens)")
    tok = from_doc(mdoc, str(model_path))
    dev = resolve_device(device or "auto", "data build")
    model = load_model(mf, dtype=resolve_compute("auto", dev), device=dev)
    eos_ids = list(mdoc.get("eos_ids") or [])
    bos_id = mdoc.get("bos_id")
    bos_s = tok.id_to_token(bos_id) if bos_id is not None else ""
    eos_s = tok.id_to_token(eos_ids[0]) if eos_ids else ""
    prompts = []
    for it in todo:
        if it.kind == "pair":
            ids = ([bos_id] if bos_id is not None else []) + tok.encode(it.prompt, add_special_tokens=False).ids
        else:
            k = next((i for i, m in enumerate(it.messages) if m["role"] == "assistant"), len(it.messages))
            it.messages = it.messages[:k]
            prompt, _ = chat_parts(it, tdoc.get("chat_template"), bos_s or "", eos_s)
            ids = tok.encode(prompt, add_special_tokens=False).ids
        if not ids:
            raise CortiqError(f"{it.where}: an empty prompt; nothing to answer")
        prompts.append(ids)
    if progress:
        progress(f"answering {len(prompts)} prompts")
    outs = generate_rows(model, prompts, max_new, eos_ids=eos_ids, slots=DEFAULT_SLOTS, desc="answers")
    for it, new in zip(todo, outs):
        out = new.tolist()
        while out and out[-1] in eos_ids:  # the record gets its own EOS; the chat template its own end of turn
            out = out[:-1]
        answer = tok.decode(out, skip_special_tokens=False)
        if it.kind == "pair":
            it.answer = answer
        else:
            it.messages = it.messages + [{"role": "assistant", "content": answer}]
    return len(todo)
