"""`fewbits quantize --calib FILE...`: the user's text calibrates the method, fewbits.json records it, and a
file that cannot serve is a one-line error before the model is loaded."""

from __future__ import annotations

import hashlib
import json

import pytest
from click.testing import CliRunner

from fewbits.cli import main
from fewbits.models import loading


@pytest.fixture
def patched(monkeypatch, tiny_llama, tiny_tokenizer):
    class Tok(type(tiny_tokenizer)):
        def save_pretrained(self, path) -> None:  # noqa: ANN001
            pass

    calls = []

    def load(name, dtype="fp32"):  # noqa: ANN001, ANN202
        calls.append(name)
        return tiny_llama, Tok()

    monkeypatch.setattr(loading, "load_model", load)
    return calls


def test_calib_file_is_used_and_recorded(patched, tmp_path) -> None:
    text = tmp_path / "play.txt"
    text.write_text("Fair is foul, and foul is fair:\nHover through the fog and filthy air.\n" * 40)
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--method", "gptq", "--calib", str(text),
                                  "--calib-samples", "6", "--calib-seq-len", "64", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    assert "calibration: files (play.txt), 6 x 64 tokens" in r.output
    cal = json.loads((out / "fewbits.json").read_text())["report"]["calibration"]
    assert cal["source"] == "files" and (cal["samples"], cal["seq_len"]) == (6, 64)
    assert cal["texts"] == [{"name": str(text), "sha256": hashlib.sha256(text.read_bytes()).hexdigest(), "windows": 6}]


def test_default_calibration_is_the_packaged_mix(patched, tmp_path) -> None:
    out = tmp_path / "q"
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--method", "awq", "--calib-windows", "4",
                                  "--calib-seq-len", "32", "-o", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    cal = json.loads((out / "fewbits.json").read_text())["report"]["calibration"]
    assert cal["source"] == "packaged mix" and [t["name"] for t in cal["texts"]] == ["verse", "prose", "code"]


def _bad(d, kind: str):  # noqa: ANN001, ANN202
    """A calibration path of the given kind of trouble under folder d."""
    if kind == "empty":
        (d / "empty.txt").write_text("")
        return d / "empty.txt"
    if kind == "binary":
        (d / "w.bin").write_bytes(b"\x00\x01\xff" * 100)
        return d / "w.bin"
    if kind == "empty folder":
        (d / "f").mkdir()
        return d / "f"
    return d / "missing.txt"


@pytest.mark.parametrize("kind, why", [("missing", "does not exist"), ("empty", "is empty"), ("binary", "not"),
                                       ("empty folder", "holds no files")])
def test_bad_calib_files_fail_before_the_model_is_loaded(patched, tmp_path, kind, why) -> None:
    path = _bad(tmp_path, kind)
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--method", "gptq", "--calib", str(path),
                                  "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and why in r.output and str(path) in r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    assert patched == [] and not (tmp_path / "x").exists()


def test_too_little_text_and_a_method_without_data_are_refused(patched, tmp_path) -> None:
    small = tmp_path / "small.txt"
    small.write_text("only a few words\n" * 10)
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--method", "gptq", "--calib", str(small),
                                  "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "fewer than the 16 samples asked" in r.output and not (tmp_path / "x").exists()
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--calib", str(small),
                                  "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "--calib is for the calibrated methods" in r.output and "rtn uses no data" in r.output
    r = CliRunner().invoke(main, ["quantize", "tiny", "--format", "int4-g32", "--method", "gptq", "--calib-samples",
                                  "0", "-o", str(tmp_path / "x")])
    assert r.exit_code != 0 and "--calib-samples" in r.output
