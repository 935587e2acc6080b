"""User text files read in chunks, so that evaluating on a file of any size takes memory independent of it.

A file is checked before any model is loaded (`check_text_file`): it must exist, be a regular file (not a
folder, a device such as /dev/zero, or a pipe), be readable and not be empty.  `stream_text` then yields
pieces of about STREAM_CHARS characters, each ending just after a line break where the piece has one (the
rest is carried to the next piece), so a token never straddles two pieces except in a line longer than a
piece.  A NUL character, or bytes that are not UTF-8, stop the stream with a TextError naming the file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from fewbits.data.texts import TextError

#: characters read from a text file at a time
STREAM_CHARS = 1 << 20


def check_text_file(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path when it is a readable, non-empty regular file; TextError saying what it is otherwise."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise TextError(f"text file {p} does not exist") from None
    except OSError as exc:
        raise TextError(f"text file {p} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else "a pipe" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        raise TextError(f"text file {p} is {kind}, not a regular file of text")
    if not os.access(p, os.R_OK):
        raise TextError(f"text file {p} cannot be read: permission denied")
    if st.st_size == 0:
        raise TextError(f"text file {p} is empty; nothing to calibrate or evaluate on")
    return p


def stream_text(path: str | os.PathLike[str], chunk_chars: int = STREAM_CHARS) -> Iterator[str]:
    """The text of a UTF-8 file in pieces of about `chunk_chars` characters, each cut after a line break."""
    p = Path(path)
    carry = ""
    read = 0
    try:
        with open(p, encoding="utf-8") as f:
            while True:
                block = f.read(chunk_chars)
                if not block:
                    break
                if "\0" in block:
                    raise TextError(f"text file {p} holds NUL characters (at character "
                                        f"{read + block.index(chr(0)):,}); it is not text")
                read += len(block)
                block = carry + block
                cut = block.rfind("\n")
                if cut < 0:  # one line longer than a piece: cut it anywhere
                    carry = ""
                    yield block
                else:
                    carry = block[cut + 1:]
                    yield block[:cut + 1]
    except UnicodeDecodeError as exc:
        raise TextError(f"text file {p} is not UTF-8 text ({exc.reason} near character {read:,})") from None
    except OSError as exc:
        raise TextError(f"text file {p} cannot be read: {exc.strerror or exc}") from None
    if carry:
        yield carry


def read_prefix(path: str | os.PathLike[str], max_chars: int = STREAM_CHARS) -> str:
    """At most about `max_chars` characters from the start of the file (whole lines where possible)."""
    out: list[str] = []
    n = 0
    for piece in stream_text(path, min(max_chars, STREAM_CHARS)):
        out.append(piece)
        n += len(piece)
        if n >= max_chars:
            break
    return "".join(out)


__all__ = ["check_text_file", "stream_text", "read_prefix", "STREAM_CHARS"]
