"""The model's chat template (from its CMF tokenizer entry), rendered in a
Jinja sandbox: a template is code that came with a model file, so it gets no
attribute access to Python internals and cannot mutate what it is given."""

from __future__ import annotations

from functools import lru_cache

from ..errors import CortiqError


class ChatError(CortiqError):
    """The template is missing, does not compile, or refuses the messages."""


@lru_cache(maxsize=4)
def _compiled(template: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ChatError(f"the chat template refused the messages: {msg}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template does not compile: {e}") from None


def render_chat(template: str | None, messages: list[dict], bos: str = "", eos: str = "",
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a conversation ([{role, content}]) under `template`."""
    import jinja2

    if not template:
        raise ChatError("the model carries no chat template: use /v1/completions")
    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                          bos_token=bos, eos_token=eos, tools=None)
    except jinja2.TemplateError as e:
        raise ChatError(f"the chat template failed: {e}") from None
