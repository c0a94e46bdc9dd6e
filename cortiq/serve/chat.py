"""The model's chat template (from its CMF tokenizer entry) rendered for a
request: through `cortiq.chat`, the one sandboxed renderer with a render
budget, since a template is code that came with a model file."""

from __future__ import annotations

from ..chat import ChatTemplateError, render_chat


def chat_prompt(template: str | None, messages: list[dict], *, bos_token: str = "", eos_token: str = "") -> str:
    """The prompt text of a chat request ([{role, content}]) under `template`, with the
    generation prompt; a model without a template is refused (ChatTemplateError)."""
    if not template:
        raise ChatTemplateError("the model carries no chat template: use /v1/completions")
    return render_chat(template, messages, "the model's chat template", bos_token=bos_token, eos_token=eos_token)
