"""User text files: checked for what they are (not "does not exist" for /dev/zero), and read in pieces so
that cutting evaluation windows from a 200 MB file takes memory independent of its size."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import pytest

from fewbits.data.textfile import check_text_file, read_prefix, stream_text
from fewbits.data.texts import TextError, texts_from_files
from fewbits.data.tokens import stream_token_windows, token_windows
from fewbits.eval.perplexity import MAX_STREAM_WINDOWS, make_windows
from fewbits.eval.run import eval_texts


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_dev_zero_is_named_for_what_it_is() -> None:
    with pytest.raises(TextError, match=r"/dev/zero is a character device, not a regular file"):
        eval_texts(["/dev/zero"])


def test_folder_pipe_nul_and_late_bad_bytes(tmp_path: Path) -> None:
    with pytest.raises(TextError, match="is a folder"):
        check_text_file(tmp_path)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TextError, match="is a pipe"):
        check_text_file(fifo)  # never opened: opening a FIFO with no writer would block
    nul = tmp_path / "zeros.txt"
    nul.write_bytes(b"hello\n" + b"\0" * 100)
    with pytest.raises(TextError, match=r"zeros\.txt holds NUL characters"):
        texts_from_files([nul], stream=True)
    late = tmp_path / "late.txt"
    late.write_bytes(b"a fine line\n" * 1000 + b"\xff\xfe")
    with pytest.raises(TextError, match=r"late\.txt is not UTF-8"):
        list(stream_text(late, chunk_chars=1000))


def test_pieces_end_at_line_breaks_and_join_to_the_text(tmp_path: Path) -> None:
    text = "".join(f"line {i} " + "x" * (i % 37) + "\n" for i in range(3000)) + "no newline at the end"
    p = tmp_path / "t.txt"
    p.write_text(text)
    pieces = list(stream_text(p, chunk_chars=1000))
    assert "".join(pieces) == text and len(pieces) > 50
    assert all(s.endswith("\n") for s in pieces[:-1])
    assert read_prefix(p, 5000) == "".join(pieces)[: len(read_prefix(p, 5000))]


def test_streamed_windows_equal_whole_text_windows(tmp_path: Path, tiny_tokenizer) -> None:
    """A byte-level tokenizer cannot merge across a cut, so the windows are exactly those of the whole text."""
    text = "".join(f"To be, or not to be {i}: that is the question.\n" for i in range(2000))
    p = tmp_path / "t.txt"
    p.write_text(text)
    for n in (1, 7, 100):
        want = token_windows(tiny_tokenizer, text, 64, n_windows=n)
        got = stream_token_windows(tiny_tokenizer, stream_text(p, chunk_chars=777), 64, n)
        assert got.equal(want)
    wins, protocol = make_windows(tiny_tokenizer, {"t": p}, seq_len=64, n_windows=None)
    assert protocol.windows_per_category == {"t": min(MAX_STREAM_WINDOWS, len(token_windows(tiny_tokenizer, text, 64)))}


def test_a_200_mb_file_takes_memory_independent_of_its_size(tmp_path: Path, tiny_tokenizer) -> None:
    """The default (4 windows) and "all" (capped at MAX_STREAM_WINDOWS) read only what they need: the
    Python heap's peak stays under 40 MB while the file is 200 MB (reading it whole took > 400 MB)."""
    p = tmp_path / "big.txt"
    line = b"The quick brown fox jumps over the lazy dog; pack my box with five dozen liquor jugs.\n"
    with p.open("wb") as f:
        block = line * (1 << 14)
        for _ in range(200_000_000 // len(block) + 1):
            f.write(block)
    assert p.stat().st_size > 200_000_000
    try:
        for windows in (4, None):
            tracemalloc.start()
            texts = eval_texts([str(p)])
            wins, protocol = make_windows(tiny_tokenizer, texts, seq_len=512, n_windows=windows)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert len(wins) == (windows or MAX_STREAM_WINDOWS)
            assert peak < 40e6, f"peak {peak / 1e6:.0f} MB for {windows} windows"
    finally:
        p.unlink()
