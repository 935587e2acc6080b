"""Hostile inputs to the numeric commands get a one-line error naming the problem (exit 1 or 2), never a
traceback, and nonsense is refused rather than planned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from fewbits.cli import main

DATA = Path(__file__).parents[1] / "models" / "data"
SMOL = json.loads((DATA / "smollm2_135m_config.json").read_text())


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _clean(r, *words: str) -> None:
    """Exit 1 or 2, no exception escaped (click turns a traceback into r.exception), the words in a short message."""
    assert r.exit_code in (1, 2), (r.exit_code, r.output)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1, r.output
    for w in words:
        assert w in lines[0], (w, r.output)


def _config(tmp_path: Path, text: str | bytes) -> str:
    p = tmp_path / "config.json"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def _with(**kw) -> str:
    return json.dumps({**SMOL, **kw})


def _deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize(("text", "words"), [
    (_with(hidden_size="576"), ("hidden_size", "'576'", "integer")),
    (_with(hidden_size=[576]), ("hidden_size", "integer")),
    (_with(hidden_size=float("nan")), ("hidden_size", "integer")),
    (_with(hidden_size=float("inf")), ("hidden_size", "integer")),
    (_with(hidden_size=True), ("hidden_size", "True", "integer")),
    (_with(hidden_size=576.7), ("hidden_size", "576.7", "integer")),
    (_with(num_hidden_layers=-3), ("num_hidden_layers", "positive")),
    ("[1, 2, 3]", ("JSON object", "list")),
    (b"\xff\xfe\x00garbage", ("UTF-8",)),
    (b"\x00\x01\x02\x03" * 64, ("not valid JSON",)),
    (_deep(100_000), ("nested",)),
    ('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}", ("not valid JSON",)),
    (_with(hidden_size=10**30), ("hidden_size", "up to")),
])
def test_bad_config_json(tmp_path: Path, text: str | bytes, words: tuple[str, ...]) -> None:
    _clean(_run("plan", "--model", _config(tmp_path, text)), *words)


def test_a_folder_named_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").mkdir()
    _clean(_run("plan", "--model", str(tmp_path / "config.json")), "config.json")
    _clean(_run("plan", "--model", str(tmp_path)), "config.json")


def test_profile_that_is_a_list(tmp_path: Path) -> None:
    p = tmp_path / "prof.json"
    p.write_text("[1, 2]")
    _clean(_run("plan", "--profile", str(p)), "prof.json")


def test_plot_into_a_missing_folder(tmp_path: Path) -> None:
    target = tmp_path / "nope" / "plan.png"
    _clean(_run("plan", "--model", "smollm2-135m", "--plot", str(target)), "nope")
    assert not target.parent.exists()


def test_kv_group_must_divide_the_head_size() -> None:
    _clean(_run("plan", "--model", "smollm2-135m", "--kv", "int4-g7"), "int4-g7", "head", "64")
    assert _run("plan", "--model", "smollm2-135m", "--kv", "int4-g32").exit_code == 0


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_layer_error_refuses_non_finite_numbers(value: str) -> None:
    for opt in ("--outlier-value", "--threshold", "--w-std"):
        _clean(_run("layer-error", opt, value), opt)


def test_layer_error_size_is_bounded() -> None:
    _clean(_run("layer-error", "--rows", "100000", "--cols", "100000"), "--rows", "--cols")
    _clean(_run("layer-error", "--rows", "0"), "--rows")


def test_try_seed_must_be_non_negative() -> None:
    _clean(_run("try", "--seed", "-1"), "--seed")
    assert _run("try", "--seed", str(2**64)).exit_code == 2
    assert _run("try", "--seed", "7").exit_code == 0


def test_nan_never_printed_as_a_result() -> None:
    for opt in ("--outlier-value", "--threshold"):
        r = _run("layer-error", opt, "nan", "--rows", "64", "--cols", "64")
        assert "nan%" not in r.output and r.exit_code == 2
