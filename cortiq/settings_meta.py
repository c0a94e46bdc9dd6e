"""Settings described once: a field's help, choices and bounds live in its metadata.

A settings dataclass declares each field with `setting(default, help, ...)`. From
that one declaration come the command-line options (`add_arguments`: one
argparse group per dataclass, nested dataclasses one group each), the dataclass
built back from the parsed options (`from_args`), the options that rebuild a
given value (`to_argv`), the bounds and choices check every `__post_init__` runs
(`check`), the same check of a parameter file's value under its YAML key
(`check_value`), and the settings table in docs/settings.md. The `#:` comment
above a field says why its default is what it is; the help says what it is.

Standard library only, and no torch: `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import types
import typing
from typing import Any

from .errors import CortiqError

MISSING = dataclasses.MISSING

#: the plan bounds shared by every stage that has such a field: values beyond them plan absurd
#: work, whichever stage they are given to
WINDOW = {"lo": 8, "hi": 1 << 20,
          "why": "a window is one model pass: under 8 tokens a run spends its time on per-pass overhead "
                 "(a window of 1 planned a 40-minute run of nothing), over 1M no attention fits"}
EPOCHS = {"hi": 1000, "why": "more than 1000 passes over the same windows only memorises them"}
BATCH = {"lo": 1, "hi": 1 << 16, "why": "a step of more than 65536 windows fits no memory"}
TOPK = {"lo": 1, "hi": 1 << 16, "why": "more than 65536 teacher entries per row is a full vocabulary, not a top-k"}


def setting(default: Any = MISSING, help: str = "", *, factory: Any = MISSING, choices: tuple | None = None,
            lo: float | None = None, hi: float | None = None, gt: float | None = None, lt: float | None = None,
            why: str = "", metavar: str | None = None, show: str | None = None, arg_type: Any = None,
            repeat: bool = False, text: Any = None, set_by: str | None = None, how: bool = False,
            feeds: tuple[str, ...] | None = None, added: bool = False, was: Any = MISSING,
            when: Any = None) -> Any:
    """A dataclass field with its description.

    help: what the setting is (one phrase; the option's help and the docs table's).
    choices: the values allowed. lo/hi: inclusive bounds; gt/lt: exclusive bounds; why: the
    reason for the bounds, shown when a value breaks them (None is never checked: it means unset).
    metavar: the option's placeholder. show: what the default means where it is None (or shown
    otherwise). arg_type: how the option's text is read when the annotation does not say
    (e.g. str for a value the dataclass parses itself). repeat: the option may be given several
    times (a list). text: how a value is written as option text (to_argv). set_by: the field is
    not set on its own: the enclosing settings' field of that name sets it (no option, no key).

    What enters a stage's digest (cortiq.runner.Stage applies it, one rule for every stage):
    how: the field says how the output is made, not what it is (device, GPUs, progress, memory
    plans that give the same numbers, output paths): it enters no digest. feeds: the names of the
    stages whose output the field changes (default: the class's FEEDS, else every stage that
    takes this settings class). added: a field added after outputs were cached under the
    stage's digest: at its default it enters no digest, so those outputs keep theirs; `was`: where an
    added field's default changed later, the value those outputs were made with, at which (and not
    at the new default) it enters no digest, so the new default's outputs are never the old. when: a
    predicate on the settings; where it is false the field changes nothing (awq_grid without
    awq) and enters no digest."""
    meta: dict[str, Any] = {"help": help}
    for k, v in (("choices", choices), ("lo", lo), ("hi", hi), ("gt", gt), ("lt", lt), ("metavar", metavar),
                 ("show", show), ("arg_type", arg_type), ("text", text), ("set_by", set_by), ("feeds", feeds),
                 ("when", when)):
        if v is not None:
            meta[k] = v
    if why:
        meta["why"] = why
    if repeat:
        meta["repeat"] = True
    if how:
        meta["how"] = True
    if added:
        meta["added"] = True
        if was is not MISSING:
            meta["was"] = was
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


@functools.lru_cache(maxsize=None)
def hints(cls) -> dict[str, Any]:
    """The resolved annotations of a dataclass (its module may use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def _strip_optional(tp: Any) -> Any:
    """T for `T | None` (and Optional[T]); tp itself otherwise."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def nested(cls, f: dataclasses.Field) -> type | None:
    """The dataclass a field holds (a settings group of its own), or None."""
    tp = _strip_optional(hints(cls)[f.name])
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def feeds(cls, f: dataclasses.Field, stage: str) -> bool:
    """Whether the field `f` of the settings class `cls` changes the output of the stage named `stage`
    (the one rule of every digest: `setting`'s how, feeds and the class's FEEDS)."""
    if f.metadata.get("how"):
        return False
    names = f.metadata.get("feeds", getattr(cls, "FEEDS", None))
    return names is None or stage in names


def what(obj, stage: str) -> dict:
    """The fields of the settings `obj` that change the output of `stage`, with their values: every
    field that feeds it, but a field `added` later at its default (or at the value it `was`) and one
    whose `when` is false.
    A nested settings group is its own such dict (the group's fields that feed the stage)."""
    cls = type(obj)
    out = {}
    for f in dataclasses.fields(obj):
        if not feeds(cls, f, stage):
            continue
        v = getattr(obj, f.name)
        if f.metadata.get("added") and v == f.metadata.get("was", default_of(f)):
            continue
        if f.metadata.get("when") is not None and not f.metadata["when"](obj):
            continue
        out[f.name] = what(v, stage) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
    return out


# ── checks ──

def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _interval(m: dict) -> str:
    """The allowed range as an error message says it: [8, 1048576], (0, 1], >= 1, < 1."""
    lo = m.get("lo", m.get("gt"))
    hi = m.get("hi", m.get("lt"))
    if lo is not None and hi is not None:
        return f"{'[' if 'lo' in m else '('}{_num(lo)}, {_num(hi)}{']' if 'hi' in m else ')'}"
    if lo is not None:
        return f"{'>=' if 'lo' in m else '>'} {_num(lo)}"
    return f"{'<=' if 'hi' in m else '<'} {_num(hi)}"


def check_value(f: dataclasses.Field, v: Any, label: str) -> None:
    """One value against its field's choices and bounds; CortiqError "<label> <value> ..." on
    one line. None (unset) passes; so does a value of another kind (the type check says so).
    A number that is not finite (nan, inf) is refused whatever the bounds: no setting means
    "unbounded" by inf, and nan passes no comparison a stage makes later."""
    m = f.metadata
    if v is None:
        return
    if any(isinstance(x, float) and not math.isfinite(x) for x in (v if isinstance(v, tuple) else (v,))):
        raise CortiqError(f"{label} {v} is not a finite number" if not isinstance(v, tuple) else
                          f"{label} {v} holds a number that is not finite")
    if "choices" in m and v not in m["choices"]:
        raise CortiqError(f"{label} {v!r} is not one of {', '.join(map(str, m['choices']))}")
    if not any(k in m for k in ("lo", "hi", "gt", "lt")) or isinstance(v, bool) or not isinstance(v, (int, float)):
        return
    ok = (("lo" not in m or v >= m["lo"]) and ("hi" not in m or v <= m["hi"])
          and ("gt" not in m or v > m["gt"]) and ("lt" not in m or v < m["lt"]))
    if not ok:
        two = (("lo" in m or "gt" in m) and ("hi" in m or "lt" in m))
        why = f": {m['why']}" if "why" in m else ""
        raise CortiqError(f"{label} {_num(v)} {'is outside' if two else 'must be'} {_interval(m)}{why}")


def check(obj, where: str) -> None:
    """Every field of a settings dataclass against its choices and bounds (its `__post_init__`
    calls this; checks that relate two fields stay there)."""
    for f in dataclasses.fields(obj):
        check_value(f, getattr(obj, f.name), f"{where}: {f.name}")


def parent_key(prefix: str, name: str) -> str:
    """The key of the field `name` of the settings that enclose the group at `prefix` ("compress.masks.")."""
    parent = prefix.rstrip(".").rpartition(".")[0]
    return f"{parent}.{name}" if parent else name


def derived_error(prefix: str, f: dataclasses.Field) -> CortiqError:
    """A field that its enclosing settings set (`set_by`), given on its own."""
    key, by = prefix + f.name, parent_key(prefix, f.metadata["set_by"])
    return CortiqError(f"{key} is not set on its own: write {by} (it sets every {f.name} under it)")


# ── the command line ──

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in its help, except where there is none to show (None)."""

    def _get_help_string(self, action):
        if action.default is None:
            return action.help
        return super()._get_help_string(action)


def _tuple_parser(elems: tuple, name: str):
    def parse(s: str):
        parts = s.split(",")
        if len(parts) != len(elems):
            raise argparse.ArgumentTypeError(f"{name}: {len(elems)} comma-separated values are needed, not {s!r}")
        try:
            return tuple(t(p) for t, p in zip(elems, parts))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: not {len(elems)} comma-separated numbers: {s!r}") from None
    return parse


def _kind(cls, f: dataclasses.Field) -> tuple[str, Any]:
    """How a field is given on the command line: ("bool" | "repeat" | "value", the text parser)."""
    tp = _strip_optional(hints(cls)[f.name])
    m = f.metadata
    if tp is bool:
        return "bool", None
    if m.get("repeat"):
        args = typing.get_args(tp)
        return "repeat", m.get("arg_type") or (args[0] if args and args[0] in (int, float, str) else str)
    if m.get("arg_type"):
        return "value", m["arg_type"]
    if tp in (int, float, str):
        return "value", tp
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and Ellipsis not in args and all(a in (int, float, str) for a in args):
        return "value", _tuple_parser(args, f.name)
    return "value", str


#: what to_argv writes for an empty list where a repeat field's default is not empty; the field's
#: dataclass reads it as the empty list (RetainSettings: `--retain-sources none`, no retain data)
NONE = "none"


class Repeat(argparse.Action):
    """A repeat option: each use adds a value, and the first use replaces the default (argparse's
    "append" adds to a non-empty default, so `--retain-sources corpus:shakespeare` would keep the
    default's corpus:pydoc too)."""

    def __call__(self, parser, namespace, value, option_string=None):
        items = getattr(namespace, self.dest)
        setattr(namespace, self.dest, ([] if items is self.default else list(items)) + [value])


def _show(v: Any) -> str:
    if isinstance(v, tuple):
        return ",".join(map(str, v))
    if isinstance(v, list):
        return " ".join(map(str, v))
    return str(v)


def named(argv: list[str] | None, command: str, add_arguments, s) -> set[str]:
    """The fields of the settings `s` that the command line `argv` (from the command's name
    `command` on) names, whatever their values (an abbreviation counts), for the refusal of an
    option that acts only with another; without that command line (a call from Python), the
    fields away from their defaults."""
    if argv is None or argv[:1] != [command]:
        return {f.name for f in dataclasses.fields(s) if getattr(s, f.name) != default_of(f)}
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    unset = object()
    # argparse sets an option's default only where the namespace lacks it: what stays unset was not given
    ns = p.parse_args(argv[1:], namespace=argparse.Namespace(**{f.name: unset for f in dataclasses.fields(s)}))
    return {f.name for f in dataclasses.fields(s) if getattr(ns, f.name, unset) is not unset}


def flag(prefix: str, name: str) -> str:
    """The option of a field: --name-with-dashes, a nested group's name in front (--masks-lr)."""
    return "--" + (prefix + name).replace(".", "-").replace("_", "-")


def add_arguments(parser, cls, prefix: str = "", title: str | None = None, skip: tuple = ()) -> None:
    """One argparse group of `cls`'s fields (`--name-with-dashes`, type from the annotation,
    --x/--no-x for booleans, choices, the default in the help); a nested settings dataclass gets
    a group of its own, its options named after it (--masks-lr). Fields `skip` names, and fields
    another field sets, get no option. A field without help gets an option without help (the
    parser walk in the tests names it)."""
    doc = (cls.__doc__ or "").strip().splitlines()
    head = doc[0].rstrip(".") if doc and not doc[0].startswith(cls.__name__ + "(") else ""
    g = parser.add_argument_group(title or (f"{prefix.rstrip('.')} ({head})" if prefix else head) or None)
    later = []
    for f in dataclasses.fields(cls):
        if f.name in skip or "set_by" in f.metadata:
            continue
        sub = nested(cls, f)
        if sub is not None:
            later.append((sub, prefix + f.name + "."))
            continue
        m = f.metadata
        kind, parse = _kind(cls, f)
        default = default_of(f)
        dest = prefix + f.name
        help_ = m.get("help", "").replace("%", "%%")
        if kind == "bool":
            if default is None:
                help_ += f" (default: {m.get('show', 'none')})%(default).0s"
            a = g.add_argument(flag(prefix, f.name), dest=dest, action=argparse.BooleanOptionalAction,
                               default=default, help=help_)
        else:
            kw: dict[str, Any] = {"dest": dest, "type": parse, "default": default,
                                  "metavar": m.get("metavar") or f.name.upper()}
            if kind == "repeat":
                kw["action"] = Repeat
            elif "choices" in m:
                kw["choices"] = m["choices"]
                kw.pop("metavar")
            if default is None or "show" in m or isinstance(default, (tuple, list)):
                # a default shown in words: "%(default).0s" (which prints nothing) keeps argparse's
                # ArgumentDefaultsHelpFormatter from adding "(default: None)" after it
                shown = m.get("show", "none" if default is None else _show(default) if default else "none")
                help_ += f" (default: {shown})%(default).0s"
            a = g.add_argument(flag(prefix, f.name), help=help_, **kw)
        if a.help is not None and "%(default)" not in a.help:
            a.help += " (default: %(default)s)"
    for sub, p in later:
        add_arguments(parser, sub, p)


def from_args(cls, args: argparse.Namespace, prefix: str = "", skip: tuple = ()):
    """The settings dataclass from parsed options (fields without an option keep their default)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or "set_by" in f.metadata:
            continue
        sub = nested(cls, f)
        kw[f.name] = from_args(sub, args, prefix + f.name + ".") if sub is not None else getattr(args, prefix + f.name)
    return cls(**kw)


def to_argv(obj, prefix: str = "", skip: tuple = ()) -> list[str]:
    """The options that parse back to `obj` (every field that has an option and a value)."""
    cls = type(obj)
    out: list[str] = []
    for f in dataclasses.fields(obj):
        if f.name in skip or "set_by" in f.metadata:
            continue
        v = getattr(obj, f.name)
        sub = nested(cls, f)
        if sub is not None:
            out += to_argv(v, prefix + f.name + ".")
            continue
        if v is None:
            continue
        kind, _ = _kind(cls, f)
        opt = flag(prefix, f.name)
        text = f.metadata.get("text", _show)
        if kind == "bool":
            out.append(opt if v else "--no-" + opt[2:])
        elif kind == "repeat":
            if not v and default_of(f):
                out += [opt, NONE]  # the empty list, where the default is not empty
            for x in v:
                out += [opt, text(x)]
        else:
            out += [opt, text(v)]
    return out


# ── the docs table ──

def rows(cls, key_prefix: str = "", options: bool = True, skip: tuple = (),
         _sub: str = "") -> list[tuple[str, str, str, str, str]]:
    """(key, option, default, allowed values, help) of every field of `cls` but those `skip`
    names: the key dotted under `key_prefix` as a parameter file writes it, the option as
    `add_arguments` names it ("" where there is none, or `options` is False), the default in
    backquotes where it is a value, in words where it is described."""
    out = []
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        m = f.metadata
        sub = nested(cls, f)
        if sub is not None:
            out += rows(sub, key_prefix, options, (), _sub + f.name + ".")
            continue
        d = default_of(f)
        if "show" in m:
            shown = m["show"]
        elif d is None or (isinstance(d, (list, tuple)) and not d):
            shown = "none"
        else:
            shown = "`" + (", ".join(map(str, d)) if isinstance(d, list) else _show(d)) + "`"
        allowed = ", ".join(map(str, m["choices"])) if "choices" in m else (
            _interval(m) if any(k in m for k in ("lo", "hi", "gt", "lt")) else "")
        opt = flag(_sub, f.name) if options and "set_by" not in m else ""
        help_ = m.get("help", "")
        if "set_by" in m:
            help_ = f"set by {parent_key(key_prefix + _sub, m['set_by'])}, not on its own"
        out.append((key_prefix + _sub + f.name, opt, shown, allowed, help_))
    return out


def table(cls, key_prefix: str = "", options: bool = True, skip: tuple = ()) -> str:
    """A Markdown table of `rows(cls, key_prefix, options, skip)`."""
    lines = ["| setting | option | default | allowed | what |", "| --- | --- | --- | --- | --- |"]
    for row in rows(cls, key_prefix, options, skip):
        key, opt, d, allowed, h = (c.replace("|", "\\|") for c in row)
        lines.append(f"| `{key}` | {f'`{opt}`' if opt else ''} | {d} | {allowed} | {h} |")
    return "\n".join(lines) + "\n"
