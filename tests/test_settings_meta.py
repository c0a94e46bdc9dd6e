"""Settings described once: every command's options come from the settings dataclasses'
metadata, so every option has help, every generated default is the dataclass's, options
and dataclasses round-trip, bounds are checked in one place, and docs/settings.md is what
the metadata says."""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing
from pathlib import Path

import pytest

from cortiq import settings_meta as sm
from cortiq.cli import build_parser, main
from cortiq.compress.settings import CompressSettings, FoldSettings, MaskSettings
from cortiq.errors import CortiqError

ROOT = Path(__file__).resolve().parents[1]

#: command -> (its settings dataclass, the arguments it requires besides its options)
COMMANDS = {
    ("compress",): ("cortiq.compress.settings:CompressSettings", ["m.cmf", "--data", "td", "--out", "o.cmf"]),
    ("heal",): ("cortiq.heal.settings:HealSettings", ["s.cmf", "--data", "td", "--out", "o.cmf"]),
    ("mtp", "heal"): ("cortiq.mtp.settings:MtpSettings", ["m.cmf", "--data", "td", "--out", "o.cmf"]),
    ("recode",): ("cortiq.quant.settings:QuantSettings", ["m.cmf", "o.cmf", "--codec", "q4"]),
    ("data", "build"): ("cortiq.data.settings:BuildSettings", ["--tokenizer", "m.cmf", "--out", "td"]),
    ("data", "self"): ("cortiq.data.settings:SelfGenSettings", ["m.cmf"]),
    ("generate",): ("cortiq.commands.generate:GenerateSettings", ["m.cmf", "hello"]),
    ("nll",): ("cortiq.commands.nll:NllSettings", ["m.cmf", "td"]),
    ("export",): ("cortiq.commands.export:ExportSettings", ["m.cmf", "--to", "hf", "out"]),
    ("serve",): ("cortiq.serve.settings:ServeSettings", ["m.cmf"]),
}


def _cls(spec: str):
    import importlib

    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _walk(p: argparse.ArgumentParser, path: tuple = ()):
    """(command path, parser) for every command and subcommand."""
    yield path, p
    for name, sp in _subparsers(p).items():
        yield from _walk(sp, path + (name,))


def undocumented(p: argparse.ArgumentParser) -> list[str]:
    """'cortiq CMD --option' for every option or argument of every command that has no help."""
    out = []
    for path, sp in _walk(p):
        for a in sp._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            text = (a.help or "").replace("%(default).0s", "")
            text = re.sub(r"\s*\(default: (%\(default\)s|[^)]*)\)$", "", text).strip()
            if not text:
                out.append(" ".join(("cortiq",) + path + ((a.option_strings[0],) if a.option_strings else (a.dest,))))
    return out


def _command(path: tuple) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        p = _subparsers(p)[name]
    return p


def test_every_option_of_every_command_has_help():
    assert undocumented(build_parser()) == []


def test_the_parser_walk_names_a_setting_without_help():
    """A field added without help metadata (a plain `gpus: int = 1`) is named, not skipped."""

    @dataclasses.dataclass
    class S:
        lr: float = sm.setting(0.1, "the rate", gt=0)
        gpus: int = 1
        quiet: bool = dataclasses.field(default=False, metadata={"help": ""})

    p = argparse.ArgumentParser(prog="x")
    sub = p.add_subparsers()
    sm.add_arguments(sub.add_parser("cmd"), S)
    assert undocumented(p) == ["cortiq cmd --gpus", "cortiq cmd --quiet"]


def test_no_default_is_typed_by_hand_in_a_command():
    for f in sorted((ROOT / "cortiq" / "commands").glob("*.py")):
        assert not re.search(r"default=[0-9]", f.read_text()), f"{f.name}: a default typed by hand"


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_generated_defaults_are_the_dataclass_defaults(path):
    cls = _cls(COMMANDS[path][0])
    p = _command(path)
    fields = {}

    def collect(c, prefix=""):
        for f in dataclasses.fields(c):
            sub = sm.nested(c, f)
            if sub is not None:
                collect(sub, prefix + f.name + ".")
            elif "set_by" not in f.metadata:
                fields[prefix + f.name] = sm.default_of(f)

    collect(cls)
    actions = {a.dest: a for a in p._actions}
    for dest, default in fields.items():
        assert dest in actions, f"{' '.join(path)}: no option for {dest}"
        assert actions[dest].default == default, dest
    # and nothing given builds exactly the dataclass's defaults
    assert sm.from_args(cls, p.parse_args(COMMANDS[path][1])) == cls()


#: values to try for a free-form string field whose grammar no generic candidate meets
VALUES = {"HealSettings.memory": ["plain", "checkpoint+micro"], "HealSettings.train_from": [1], "SelfGenSettings.mix": [(0.5, 0.25, 0.25)]}


def _candidates(cls, f: dataclasses.Field) -> list:
    """Values to try for a field other than its default (the first the dataclass accepts is used)."""
    if f"{cls.__name__}.{f.name}" in VALUES:
        return VALUES[f"{cls.__name__}.{f.name}"]
    tp = sm._strip_optional(sm.hints(cls)[f.name])
    m, d = f.metadata, sm.default_of(f)
    if tp is bool:
        return [not d] if d is not None else [True, False]
    if "choices" in m:
        return [c for c in m["choices"] if c != d]
    lo = m.get("lo", m.get("gt"))
    hi = m.get("hi", m.get("lt"))
    if tp in (int, float):
        base = [] if d is None else [d + 1, d * 2, d - 1, d / 2]
        vals = base + [x for x in (lo, hi) if x is not None] + [8, 2, 1, 0.5, 0.25, 16, 64]
        vals = [tp(v) for v in vals if v is not None]
        return [v for v in vals if v != d]
    if typing.get_origin(tp) is tuple and d:
        return [tuple(reversed(d))]
    if m.get("repeat"):
        return [["q8:x.cmf"], ["x"], ["x=2"]]
    return ["q8", "x1", "cuda:1", "d:1,2"]


#: fields that another must accompany (a check relates the two): class.field -> the others' values
COMPANIONS = {"MtpSettings.hold_all": {"epochs": 0.0}}


def _variants(cls):
    """(field path, an instance of `cls` with that one field away from its default), for every field."""
    for f in dataclasses.fields(cls):
        if "set_by" in f.metadata:
            continue
        sub = sm.nested(cls, f)
        if sub is not None:
            for name, v in _variants(sub):
                yield f"{f.name}.{name}", cls(**{f.name: v})
            continue
        for value in _candidates(cls, f):
            try:
                obj = cls(**{f.name: value, **COMPANIONS.get(f"{cls.__name__}.{f.name}", {})})
            except CortiqError:
                continue
            if obj != cls():
                yield f.name, obj
                break
        else:
            raise AssertionError(f"{cls.__name__}.{f.name}: no value other than its default is accepted")


@pytest.mark.parametrize("path", list(COMMANDS), ids=" ".join)
def test_options_and_settings_round_trip(path):
    """settings -> options -> parsed -> settings is the identity, field by field, and the
    options written again are the same."""
    spec, required = COMMANDS[path]
    cls = _cls(spec)
    p = _command(path)
    seen = 0
    for name, obj in _variants(cls):
        argv = sm.to_argv(obj)
        back = sm.from_args(cls, p.parse_args(required + argv))
        assert back == obj, name
        assert sm.to_argv(back) == argv, name
        seen += 1
    assert seen >= len(dataclasses.fields(cls)) - 1


@pytest.mark.parametrize("cmd", ["compress", "heal"])
def test_a_repeat_option_replaces_its_default_and_none_empties_it(cmd):
    """retain.sources defaults to [corpus:pydoc]: a first --retain-sources replaces it (argparse's
    append would keep it too), `none` means no retain data, and each parses back from to_argv."""
    from cortiq.data.settings import DEFAULT_RETAIN, RetainSettings

    p = _command((cmd,))
    req = COMMANDS[(cmd,)][1]

    def parsed(*argv):
        return sm.from_args(RetainSettings, p.parse_args(req + list(argv)), prefix="retain.").sources

    assert parsed() == [DEFAULT_RETAIN] == RetainSettings().sources
    assert parsed("--retain-sources", "corpus:shakespeare") == ["corpus:shakespeare"]
    assert parsed("--retain-sources", "self", "--retain-sources", "corpus:pydoc") == ["self", "corpus:pydoc"]
    assert parsed("--retain-sources", "none") == [] == RetainSettings(sources=["none"]).sources
    assert parsed() == [DEFAULT_RETAIN]  # the default was not changed in place by the parses before
    for sources in ([], ["self"], [DEFAULT_RETAIN, "x.tdata"]):
        obj = RetainSettings(sources=sources)
        argv = sm.to_argv(obj, prefix="retain.")
        assert parsed(*argv) == sources, argv
    assert sm.to_argv(RetainSettings(sources=[]), prefix="retain.")[:2] == ["--retain-sources", "none"]
    with pytest.raises(CortiqError, match=r"none \(no retain data\) named with other sources"):
        RetainSettings(sources=["none", "self"])


def test_one_keep_frac_sets_the_masks_and_the_fold():
    s = CompressSettings(keep_frac=0.5)
    assert s.masks.keep_frac == s.fold.keep_frac == 0.5
    # from the command line too: one option, no per-group one
    p = _command(("compress",))
    args = p.parse_args(COMMANDS[("compress",)][1] + ["--keep-frac", "0.6"])
    s = sm.from_args(CompressSettings, args)
    assert (s.keep_frac, s.masks.keep_frac, s.fold.keep_frac) == (0.6, 0.6, 0.6)
    assert not any("keep" in o and o != "--keep-frac" for a in p._actions for o in a.option_strings)
    # a group built with another share is a contradiction, not silently overridden
    with pytest.raises(CortiqError, match=r"^compress settings: fold.keep_frac 0.5 differs from keep_frac 0.75: "):
        CompressSettings(fold=FoldSettings(keep_frac=0.5))
    with pytest.raises(CortiqError, match=r"^compress.masks.keep_frac is not set on its own: write compress.keep_frac"):
        CompressSettings(masks={"keep_frac": 0.5})
    # groups given as mappings take the share too
    s = CompressSettings(keep_frac=0.4, masks={"lr": 0.1}, fold={"repair": True})
    assert (s.masks.keep_frac, s.masks.lr, s.fold.keep_frac, s.fold.repair) == (0.4, 0.1, 0.4, True)


@pytest.mark.parametrize("meta, value, message", [
    ({"lo": 1}, 0, "x: n 0 must be >= 1"),
    ({"gt": 0}, 0.0, "x: n 0 must be > 0"),
    ({"hi": 5}, 6, "x: n 6 must be <= 5"),
    ({"lt": 1}, 1.0, "x: n 1 must be < 1"),
    ({"lo": 8, "hi": 1 << 20}, 4, "x: n 4 is outside [8, 1048576]"),
    ({"gt": 0, "hi": 1}, 1.5, "x: n 1.5 is outside (0, 1]"),
    ({"lo": 0, "lt": 1, "why": "a share"}, -0.5, "x: n -0.5 is outside [0, 1): a share"),
    ({"choices": ("a", "b")}, "c", "x: n 'c' is not one of a, b"),
])
def test_bounds_and_choices_are_one_line_naming_the_field(meta, value, message):
    f = dataclasses.field(default=None, metadata=meta)
    f.name = "n"
    with pytest.raises(CortiqError) as e:
        sm.check_value(f, value, "x: n")
    assert str(e.value) == message
    # the edges themselves pass, and None (unset) is never checked
    for ok in [meta.get("lo"), meta.get("hi"), None] + list(meta.get("choices", ())):
        if ok is not None or "choices" not in meta:
            sm.check_value(f, ok, "x: n")


def test_a_bound_is_checked_the_same_from_python_the_command_line_and_a_parameter_file(tmp_path, capsys):
    from cortiq.heal.settings import HealSettings
    from cortiq.settings import load_settings

    with pytest.raises(CortiqError, match=r"^heal settings: warm 1 is outside \[0, 1\)$"):
        HealSettings(warm=1.0)
    assert main(["heal", "s.cmf", "--data", "td", "--out", str(tmp_path / "o.cmf"), "--warm", "1"]) == 1
    assert capsys.readouterr().err == "cortiq: heal settings: warm 1 is outside [0, 1)\n"
    (tmp_path / "p.yaml").write_text("heal:\n  warm: 1.0\n")
    with pytest.raises(CortiqError) as e:
        load_settings(tmp_path / "p.yaml")
    assert str(e.value) == f"{tmp_path / 'p.yaml'}: heal.warm 1 is outside [0, 1)"
    assert not (tmp_path / "o.cmf").exists()


def test_the_settings_doc_is_what_the_metadata_says():
    from cortiq.settings_doc import settings_doc

    text = settings_doc()
    assert (ROOT / "docs" / "settings.md").read_text() == text, \
        "docs/settings.md is stale: python -m cortiq.settings_doc > docs/settings.md"
    # every setting of every command is in it: its option, default and help
    for spec, _ in COMMANDS.values():
        for key, opt, default, _, help_ in sm.rows(_cls(spec)):
            assert help_ and default, key
            if opt:  # (a field another sets has none)
                assert f"| `{opt}` | {default} |" in text and help_ in text, key


def test_command_choices_are_the_librarys_own():
    """Where a library function checks its own argument (it may be called without the command),
    the command's choices are the same values."""
    from cortiq.commands.export import ExportSettings
    from cortiq.export.gguf import PRE_NAMES
    from cortiq.export.hf import DTYPES

    f = ExportSettings.__dataclass_fields__
    assert set(f["dtype"].metadata["choices"]) == set(DTYPES)
    assert tuple(f["pre"].metadata["choices"]) == PRE_NAMES
    from cortiq.codecs import Q4_GRIDS
    from cortiq.quant.settings import QuantSettings

    assert tuple(QuantSettings.__dataclass_fields__["q4_grid"].metadata["choices"]) == Q4_GRIDS
