"""The sandboxed chat-template renderer: templates are code from model files."""

from __future__ import annotations

import resource
import subprocess
import sys

import pytest

from cortiq.chat import ChatTemplateError, render_chat, validate_template

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MSGS = [{"role": "user", "content": "hi <b> & 'you'"}]


def test_renders_as_transformers_does():
    # the reference: transformers' own renderer (a plain sandbox with the same globals)
    from transformers.utils.chat_template_utils import render_jinja_template

    for t in [CHATML, "{{ messages|tojson }}{{ bos_token }}|{{ eos_token }}",
              "{% for m in messages %}{% if loop.first %}{% continue %}{% endif %}{{ m.content }}{% endfor %}"]:
        msgs = MSGS + [{"role": "assistant", "content": "ünïcode ✓"}]
        want, _ = render_jinja_template(conversations=[msgs], chat_template=t, add_generation_prompt=True,
                                        bos_token="<s>", eos_token="</s>")
        assert render_chat(t, msgs, "m", add_generation_prompt=True, bos_token="<s>", eos_token="</s>") == want[0]


def test_a_template_cannot_reach_python(tmp_path):
    mark = tmp_path / "ran"
    for t in [f"{{{{ cycler.__init__.__globals__.os.popen('touch {mark}').read() }}}}",
              f"{{{{ joiner.__init__.__globals__['os'].system('touch {mark}') }}}}",
              "{{ ''.__class__.__mro__[1].__subclasses__() }}",
              "{% set x = messages.append(1) %}"]:
        with pytest.raises(ChatTemplateError, match=r"^m\.cmf: the chat template failed: SecurityError"):
            render_chat(t, MSGS, "m.cmf")
    assert not mark.exists()


@pytest.mark.parametrize("t, why", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "steps|over"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "steps"),
    # no loop at all: a macro calling itself twice, thirty deep (2**30 calls)
    ("{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% endif %}{% endmacro %}{{ m(30) }}", "steps|over"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "items"),
    ("{% set ns = namespace(n=3) %}{% for i in range(40) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "bits"),
    ("{{ 'x' * 1000000000 }}", "items"), ("{{ 2 ** 1000000000 }}", "bits"),
    ("{{ (range(100000)|list) * 100000 }}", "items"),
    ("{{ 'x'|center(1000000000) }}", "center"), ("{{ 'x'|indent(100000000) }}", "indent"),
    ("{{ '%1000000000d' % 1 }}", "width"), ("{{ '%*d' % (1000000000, 1) }}", "argument"),
    ("{{ '{:>1000000000}'.format(1) }}", "width"), ("{{ 'x'.ljust(1000000000) }}", "ljust"),
    ("{{ ('a' * 100000)|replace('', 'bbbbbbbbbbbbbbbbbbbbb') }}", "replace"),
    ("{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}", "in all|characters"),
])
def test_render_budget(t, why):
    # each would take gigabytes or minutes unchecked; the cap makes a regression fail, not swap
    # a tenth of the default step budget keeps the test short; the sizes are the defaults
    with pytest.raises(ChatTemplateError, match=rf"^m: the chat template exceeds its render budget: .*({why})"):
        render_chat(t, MSGS, "m", max_steps=200_000)


def test_render_budget_in_a_capped_process():
    # the same under a 1 GiB address-space cap and a timeout: the render fails cleanly, in bounded memory
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
            "from cortiq.chat import render_chat, ChatTemplateError\n"
            "try:\n render_chat(\"{% for i in range(100000) %}{{ 'y' * 100000 }}{% endfor %}\", [], 'm')\n"
            "except ChatTemplateError as e: print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "render budget" in r.stdout, r.stderr


def test_errors_are_one_line():
    with pytest.raises(ChatTemplateError, match=r"^m: the chat template does not compile \(line 1"):
        render_chat("{% for %}", MSGS, "m")
    with pytest.raises(ChatTemplateError, match=r"^m: the chat template refused the messages: no system$"):
        render_chat("{{ raise_exception('no system') }}", MSGS, "m")
    with pytest.raises(ChatTemplateError, match=r"recursed"):
        render_chat("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}", MSGS, "m")
    with pytest.raises(ChatTemplateError, match=r"not a string"):
        render_chat(["x"], MSGS, "m")
    with pytest.raises(ChatTemplateError, match=r"ZeroDivisionError"):
        validate_template("{{ 1 // 0 }}", "m")
    validate_template(CHATML, "m")
    validate_template(None, "m")


def test_a_failed_render_leaves_the_next_one_its_full_budget():
    with pytest.raises(ChatTemplateError):
        render_chat("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", MSGS, "m")
    # 150k steps: over what is left of the first render's budget, well under a fresh one
    t = "{% for i in range(1000) %}{% for j in range(150) %}{% endfor %}{% endfor %}ok"
    assert render_chat(t, MSGS, "m") == "ok"
    with pytest.raises(ChatTemplateError, match="over 1000 steps"):
        render_chat(t, MSGS, "m", max_steps=1000)
