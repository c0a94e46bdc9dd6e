"""Chats as text: a chat rendered in the model's own template (sandboxed, cortiq.chat),
and split into the prompt the model is given and the answer it is scored on."""

from __future__ import annotations

from ..errors import CortiqError
from .sources import Item


def chat_text(template: str | None, messages: list[dict], where: str, *, add_generation_prompt: bool = True,
              bos_token: str = "", eos_token: str = "") -> str:
    """`messages` in the model's chat template (`cortiq.chat.render_chat`); without one, plain
    `role: content` paragraphs."""
    if not template:
        text = "".join(f"{m['role']}: {m['content']}\n\n" for m in messages)
        return text + ("assistant: " if add_generation_prompt else "")
    from ..chat import render_chat

    return render_chat(template, messages, where, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                       eos_token=eos_token)


def chat_parts(item: Item, template: str | None, bos: str, eos: str) -> tuple[str, str]:
    """(prompt, answer) of a chat: the prompt is everything before the first assistant turn
    (with the generation prompt), the answer the rest of the rendered chat."""
    msgs = item.messages
    k = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if k is None:
        return chat_text(template, msgs, item.where, bos_token=bos, eos_token=eos), ""
    prompt = chat_text(template, msgs[:k], item.where, bos_token=bos, eos_token=eos)
    full = chat_text(template, msgs, item.where, add_generation_prompt=False, bos_token=bos, eos_token=eos)
    if not full.startswith(prompt):
        raise CortiqError(f"{item.where}: the chat template does not render the prompt as the start of the chat")
    return prompt, full[len(prompt):]
