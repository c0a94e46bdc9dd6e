"""The model's chat template (from its CMF tokenizer entry) rendered for a
request: through `cortiq.chat`, the one sandboxed renderer with a render
budget, since a template is code that came with a model file."""

from __future__ import annotations

from .. import chat
from ..chat import ChatTemplateError as ChatError  # noqa: F401  (the server's name for it)


def render_chat(template: str | None, messages: list[dict], bos: str = "", eos: str = "",
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation ([{role, content}]) under `template`."""
    if not template:
        raise ChatError("the model carries no chat template: use /v1/completions")
    return chat.render_chat(template, messages, "the model's chat template", add_generation_prompt=add_generation_prompt,
                            bos_token=bos, eos_token=eos)
