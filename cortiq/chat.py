"""Chat templates: the one place a model's Jinja chat template is rendered.

A chat template comes from the model file (a CMF document, a Hugging Face
`tokenizer_config.json`, a GGUF key), so it is untrusted code. It is rendered
in `jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute walk to
`__globals__`, no mutation of lists and dicts) under a render budget:

* every value the template builds — a string, a list, a concatenation, a
  buffered block, the output — stays under `max_chars` characters, checked
  *before* the amplifying operations (`*`, `+`, `~`, `%`, `center`,
  `str.ljust`, `replace`, format widths...) allocate anything;
* integers stay under 2**16 bits (`2 ** 10 ** 9` is refused, not computed);
* the render runs at most `max_steps` steps — loop iterations, calls (macros
  included), operators, filters — and `max_seconds` seconds, so a nested
  `range(100000)` loop that writes nothing, or a macro that calls itself twice
  thirty deep, still stops;
* recursion (a macro calling itself) is caught.

A failure is one line (`ChatTemplateError`, a `CortiqError`) naming where the
template came from. Compiled templates are cached by their text: a data build
renders the same template thousands of times.

The globals are what Hugging Face `transformers` gives a template
(`raise_exception`, `strftime_now`, `tojson` without HTML escaping, the
`loopcontrols` extension), so a conversation renders as it does there.
"""

from __future__ import annotations

import functools
import json
import re
import threading
import time

from .errors import CortiqError

#: characters any value (and the output) may reach; a long chat is well under it
MAX_CHARS = 1 << 20
#: steps one render may take; a real template takes tens per message
MAX_STEPS = 2_000_000
#: wall time one render may take
MAX_SECONDS = 5.0
#: bits an integer may reach (a loop of squarings, `2 ** 10 ** 9`)
_MAX_INT_BITS = 1 << 16
#: a render may build this many times `max_chars` in all (the values it throws away included)
_BUILT_FACTOR = 32


class ChatTemplateError(CortiqError):
    """A chat template that does not compile, fails, or runs past its render budget."""


class _Budget(Exception):
    """Raised inside a render when it exceeds its budget (turned into ChatTemplateError)."""


class _Refused(Exception):
    """Raised by the template's `raise_exception` (the template rejects the conversation)."""


_state = threading.local()


def _limit() -> int:
    return getattr(_state, "max_chars", MAX_CHARS)


def _step():
    """One step of the render: a loop iteration, a call, an operator, a filter. Every
    1024 steps the clock is read too."""
    left = _state.steps_left = getattr(_state, "steps_left", MAX_STEPS) - 1
    if left & 1023 == 0:
        if left <= 0:
            raise _Budget(f"the render ran over {_state.max_steps} steps")
        if time.monotonic() > _state.deadline:
            raise _Budget(f"the render ran over {_state.max_seconds:g} s")


def _stepped(iterable):
    """A loop's iterable, one step per item (the compiler wraps every `for` in it)."""
    for x in iterable:
        _step()
        yield x


def _check_size(v, what: str):
    """`v` itself, refused when it is larger than the budget allows."""
    if isinstance(v, bool):
        return v
    if isinstance(v, int):
        if v.bit_length() > _MAX_INT_BITS:
            raise _Budget(f"{what} makes an integer of {v.bit_length()} bits")
    elif isinstance(v, (str, bytes, list, tuple, dict, set, frozenset)):
        if len(v) > _limit():
            raise _Budget(f"{what} makes a value of {len(v)} items (limit {_limit()})")
        _charge(len(v))
    return v


def _charge(n: int):
    """Count `n` more items built by this render: values a block buffers are only joined (and
    checked) at its end, so the total built is bounded too."""
    _state.built = getattr(_state, "built", 0) + n
    if _state.built > _BUILT_FACTOR * _limit():
        raise _Budget(f"the render built over {_BUILT_FACTOR * _limit()} items in all")


def _check_ints(args, what: str):
    """Integer arguments above the size budget (a width, a count) are refused before the call."""
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > _limit():
            raise _Budget(f"{what} with argument {a} (limit {_limit()})")


#: a printf conversion's width and precision (`%-10.3f`, `%*d`, `%(name)20s`)
_PCT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")
#: numbers in a str.format spec (`{:>100}`, `{0:.5f}`)
_FMT_NUM = re.compile(r"\d+")


def _check_format(fmt, args, what: str):
    """A format string whose widths (or `*` arguments) would build a value over the budget."""
    if not isinstance(fmt, str):
        return
    for m in _PCT.finditer(fmt):
        for g in m.groups():
            if g and g != "*" and int(g) > _limit():
                raise _Budget(f"{what}: width {g} (limit {_limit()})")
    for spec in re.findall(r"\{[^{}]*\}", fmt):
        for n in _FMT_NUM.findall(spec):
            if int(n) > _limit():
                raise _Budget(f"{what}: width {n} (limit {_limit()})")
    _check_ints(args if isinstance(args, (tuple, list)) else (args,), what)


def _check_replace(s: str, old, new, what: str):
    """`s.replace(old, new)` refused before it runs when the result would be over the budget
    (an empty `old` inserts `new` between every two characters)."""
    old, new = str(old), str(new)
    n = (len(s) + 1) if not old else s.count(old)
    if len(s) + n * max(len(new) - len(old), 0) > _limit():
        raise _Budget(f"{what} makes a string over {_limit()} characters")


def _bounded_join(seq) -> str:
    """`"".join` (Jinja's buffers and `~`), refused before joining when the sum is over the budget."""
    _step()
    parts = [p if isinstance(p, str) else str(p) for p in seq]
    n = sum(map(len, parts))
    if n > _limit():
        raise _Budget(f"a string of {n} characters (limit {_limit()})")
    _charge(n)
    return "".join(parts)


def _binop(op: str, a, b):
    """`*`, `**`, `+` and `%` with the result's size checked before it is made."""
    _step()
    if op == "*":
        for s, k in ((a, b), (b, a)):
            if isinstance(s, (str, list, tuple)) and isinstance(k, int):
                if len(s) * max(k, 0) > _limit():
                    raise _Budget(f"'*' makes {len(s) * k} items (limit {_limit()})")
        if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_INT_BITS:
            raise _Budget(f"'*' makes an integer of over {_MAX_INT_BITS} bits")
        return _check_size(a * b, "'*'")
    if op == "**":
        if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1 and a.bit_length() * b > _MAX_INT_BITS:
            raise _Budget(f"'**' makes an integer of about {a.bit_length() * b} bits")
        try:
            return _check_size(a**b, "'**'")
        except OverflowError:
            raise _Budget("'**' overflows") from None
    if op == "+":
        if isinstance(a, (str, list, tuple)) and isinstance(b, (str, list, tuple)) and len(a) + len(b) > _limit():
            raise _Budget(f"'+' makes {len(a) + len(b)} items (limit {_limit()})")
        return _check_size(a + b, "'+'")
    if op == "%":
        if isinstance(a, str):
            _check_format(a, b, "'%'")
        return _check_size(a % b, "'%'")
    raise AssertionError(op)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # as transformers renders it: no HTML escaping (a template is not a web page)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise _Refused(str(message))


def _strftime_now(fmt):
    _check_format(fmt, (), "strftime_now")
    return time.strftime(str(fmt))


def _bounded_filter(name: str, f):
    """A Jinja filter with its integer arguments and its result held to the budget."""

    # a filter marked to take the context / environment first (`jinja_pass_arg`) gets it as
    # args[0]; functools.wraps copies the mark, so Jinja passes it to the wrapper too
    skip = 1 if hasattr(f, "jinja_pass_arg") else 0

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        _step()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        _check_ints(list(rest) + list(kwargs.values()), f"filter {name}")
        if name == "replace" and len(rest) >= 2 and isinstance(value, str):
            _check_replace(value, rest[0], rest[1], "filter replace")
        if name == "format":
            _check_format(value, rest, "filter format")
        return _check_size(f(*args, **kwargs), f"filter {name}")

    return wrapper


#: the filter name the compiler gives `_stepped` (not a name a template would use)
_STEP_FILTER = "cortiq_render_step"


@functools.lru_cache(maxsize=1)
def _env():
    import jinja2
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: joined under the budget
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Env(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def _parse(self, source, name, filename):
            # every loop's iterable goes through `_stepped`: one budget step per iteration
            tree = super()._parse(source, name, filename)
            for node in tree.find_all(jinja2.nodes.For):
                node.iter = jinja2.nodes.Filter(node.iter, _STEP_FILTER, [], [], None, None, lineno=node.iter.lineno)
            return tree

        def call_binop(self, context, operator, left, right):
            return _binop(operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (the sandbox's signature)
            _step()
            _check_ints(list(args) + list(kwargs.values()), f"calling {getattr(__obj, '__name__', 'a function')}")
            target = getattr(__obj, "__wrapped__", __obj)
            if getattr(target, "__name__", "") in ("format", "format_map") and isinstance(getattr(target, "__self__", None), str):
                _check_format(target.__self__, list(args) + list(kwargs.values()), "str.format")
            if getattr(target, "__name__", "") == "replace" and isinstance(getattr(target, "__self__", None), str) and len(args) >= 2:
                _check_replace(target.__self__, args[0], args[1], "str.replace")
            out = super().call(__context, __obj, *args, **kwargs)
            return _check_size(out, f"calling {getattr(__obj, '__name__', 'a function')}")

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.concat = _bounded_join
    env.filters = {k: _bounded_filter(k, f) for k, f in env.filters.items()}
    env.filters["tojson"] = _bounded_filter("tojson", _tojson)
    env.filters[_STEP_FILTER] = _stepped
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env, jinja2


@functools.lru_cache(maxsize=16)
def _compiled(template: str):
    env, jinja2 = _env()
    return env.from_string(template)


def compile_template(template: str, where: str):
    """The compiled template; a syntax error is one line naming `where`."""
    _, jinja2 = _env()
    if not isinstance(template, str):
        raise ChatTemplateError(f"{where}: the chat template is {type(template).__name__}, not a string")
    if len(template) > MAX_CHARS:
        raise ChatTemplateError(f"{where}: the chat template is {len(template)} characters (limit {MAX_CHARS})")
    try:
        return _compiled(template)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{where}: the chat template does not compile (line {e.lineno}: {e.message})") from None
    except (RecursionError, MemoryError):
        raise ChatTemplateError(f"{where}: the chat template is nested too deeply to compile") from None
    except Exception as e:  # noqa: BLE001 (Jinja's compiler raises plain errors on odd input)
        raise ChatTemplateError(f"{where}: the chat template does not compile ({type(e).__name__}: {e})") from None


def render_template(
    template: str,
    where: str,
    *,
    max_chars: int = MAX_CHARS,
    max_steps: int = MAX_STEPS,
    max_seconds: float = MAX_SECONDS,
    **variables,
) -> str:
    """`template` rendered with `variables`, in the sandbox and under the render budget."""
    _, jinja2 = _env()
    t = compile_template(template, where)
    saved = dict(vars(_state))  # a template rendered from inside another render's call keeps its budget
    _state.max_chars, _state.built, _state.max_steps, _state.steps_left = max_chars, 0, max_steps, max_steps
    _state.max_seconds, _state.deadline = max_seconds, time.monotonic() + max_seconds
    out: list[str] = []
    n = 0
    try:
        for chunk in t.generate(**variables):
            n += len(chunk)
            if n > max_chars:
                raise _Budget(f"the output is over {max_chars} characters")
            out.append(chunk)
    except _Budget as e:
        raise ChatTemplateError(f"{where}: the chat template exceeds its render budget: {e}") from None
    except _Refused as e:
        raise ChatTemplateError(f"{where}: the chat template refused the messages: {e}") from None
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from None
    except RecursionError:
        raise ChatTemplateError(f"{where}: the chat template recursed too deeply") from None
    except MemoryError:
        raise ChatTemplateError(f"{where}: the chat template ran out of memory") from None
    except Exception as e:  # noqa: BLE001 (template code raises what Python raises: a bad operand, a missing key...)
        raise ChatTemplateError(f"{where}: the chat template failed: {type(e).__name__}: {e}") from None
    finally:
        vars(_state).clear()
        vars(_state).update(saved)
    return "".join(out)


def render_chat(
    template: str,
    messages: list[dict],
    where: str,
    *,
    add_generation_prompt: bool = True,
    bos_token: str = "",
    eos_token: str = "",
    tools: list | None = None,
    **budget,
) -> str:
    """`messages` in the chat template, as transformers' `apply_chat_template` renders them."""
    return render_template(template, where, messages=messages, add_generation_prompt=add_generation_prompt,
                           bos_token=bos_token, eos_token=eos_token, tools=tools, **budget)


#: the conversation a template is tried on when a model is converted
SAMPLE_MESSAGES = [{"role": "user", "content": "Hello."}]


def validate_template(template: str | None, where: str) -> None:
    """A chat template a converter is about to store: it must compile and render one user
    message within the budget (a template that cannot is refused now, not at first use)."""
    if template is None:
        return
    render_chat(template, SAMPLE_MESSAGES, where, add_generation_prompt=True)
