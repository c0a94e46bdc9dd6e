"""Chats as text: a chat rendered in the model's own template (sandboxed, cortiq.chat),
and split into the prompt the model is given and the answer it is scored on."""

from __future__ import annotations

from ..errors import CortiqError
from .sources import Item


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool, bos: str, eos: str,
                where: str) -> str:
    """`messages` in the model's chat template (a Jinja string, rendered as transformers does);
    without one, plain `role: content` paragraphs."""
    if not template:
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
    from ..chat import render_chat as render

    return render(template, messages, where, add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos)


def chat_parts(item: Item, template: str | None, bos: str, eos: str) -> tuple[str, str]:
    """(prompt, answer) of a chat: the prompt is everything before the first assistant turn
    (with the generation prompt), the answer the rest of the rendered chat."""
    msgs = item.messages
    k = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if k is None:
        return render_chat(template, msgs, True, bos, eos, item.where), ""
    prompt = render_chat(template, msgs[:k], True, bos, eos, item.where)
    full = render_chat(template, msgs, False, bos, eos, item.where)
    if not full.startswith(prompt):
        raise CortiqError(f"{item.where}: the chat template does not render the prompt as the start of the chat")
    return prompt, full[len(prompt):]
