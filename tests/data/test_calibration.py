"""Calibration data: the packaged mix as `fewbits quantize` always drew it, user files and folders, the
record of what was used, and one-line errors for files that cannot give the samples asked."""

from __future__ import annotations

import hashlib

import pytest
import torch

from fewbits.data.calibration import CalibrationInputError, calibration_data, check_calibration_files
from fewbits.data.texts import load_texts
from fewbits.data.tokens import token_windows


def test_packaged_mix_is_the_first_windows_of_each_calibration_text(tiny_tokenizer):
    """16 samples from 3 texts: the first 6 windows of verse and prose and the first 4 of code, in that order
    (ceil(16 / 3) = 6 per text, cut to 16), built here from the texts directly."""
    data = calibration_data(tiny_tokenizer, samples=16, seq_len=64)
    texts = load_texts("calib")
    want = torch.cat([token_windows(tiny_tokenizer, texts[c], 64, n_windows=6) for c in ("verse", "prose", "code")])
    assert torch.equal(data.ids, want[:16]) and data.ids.dtype == torch.long
    assert data.source == "packaged mix" and (data.samples, data.seq_len) == (16, 64)
    assert [(t["name"], t["windows"]) for t in data.texts] == [("verse", 6), ("prose", 6), ("code", 4)]
    assert data.texts[0]["sha256"] == hashlib.sha256(texts["verse"].encode()).hexdigest()
    assert "Macbeth" in data.texts[0]["what"]
    assert tiny_tokenizer.decode(data.ids[0].tolist())[:30] not in load_texts("eval")["verse"]  # never Hamlet


def test_files_and_folders_with_their_hashes(tmp_path, tiny_tokenizer):
    a = tmp_path / "a.txt"
    a.write_text("alpha beta gamma delta\n" * 200)
    folder = tmp_path / "more"
    folder.mkdir()
    (folder / "b.md").write_text("one two three four five\n" * 200)
    (folder / ".hidden").write_bytes(b"\0\1\2")  # hidden files in a folder are left out
    data = calibration_data(tiny_tokenizer, files=[a, folder], samples=5, seq_len=32)
    assert data.source == "files" and data.ids.shape == (5, 32)
    assert [t["name"] for t in data.texts] == [str(a), str(folder / "b.md")]
    assert [t["windows"] for t in data.texts] == [3, 2]
    assert data.texts[0]["sha256"] == hashlib.sha256(a.read_bytes()).hexdigest()
    text = tiny_tokenizer.decode(data.ids[0].tolist())
    assert text.lstrip("\x01").startswith("alpha beta")
    assert "files (a.txt, b.md), 5 x 32 tokens" in data.text()


def test_a_short_file_lends_its_share_to_the_others(tmp_path, tiny_tokenizer):
    short, long = tmp_path / "short.txt", tmp_path / "long.txt"
    short.write_text("tiny text\n")  # shorter than one window
    long.write_text("a fairly long line of text for windows\n" * 100)
    data = calibration_data(tiny_tokenizer, files=[short, long], samples=6, seq_len=64)
    assert [t["windows"] for t in data.texts] == [0, 6]
    want = token_windows(tiny_tokenizer, long.read_text(), 64, n_windows=6)
    assert torch.equal(data.ids, want)


def test_bad_files_are_one_line_errors_naming_them(tmp_path, tiny_tokenizer):
    empty, binary, blank = tmp_path / "empty.txt", tmp_path / "model.bin", tmp_path / "blank.txt"
    empty.write_text("")
    binary.write_bytes(bytes(range(256)) * 4)
    blank.write_text("   \n\n  ")
    (tmp_path / "nothing").mkdir()
    cases = [(tmp_path / "missing.txt", "does not exist"), (empty, "is empty"), (binary, "not"),
             (blank, "only white space"), (tmp_path / "nothing", "holds no files")]
    for path, why in cases:
        with pytest.raises(CalibrationInputError, match=why) as e:
            check_calibration_files([path])
        assert str(path) in str(e.value) and "\n" not in str(e.value)
    small = tmp_path / "small.txt"
    small.write_text("just a few words of text here\n" * 4)
    with pytest.raises(CalibrationInputError, match=r"1 file\(s\) give 1 window\(s\) of 64 tokens, fewer than "
                                                     r"the 16 samples asked"):
        calibration_data(tiny_tokenizer, files=[small], samples=16, seq_len=64)
    with pytest.raises(CalibrationInputError, match="samples must be a positive integer"):
        calibration_data(tiny_tokenizer, samples=0)
    with pytest.raises(CalibrationInputError, match="length must be an integer of at least 2"):
        calibration_data(tiny_tokenizer, seq_len=1)
