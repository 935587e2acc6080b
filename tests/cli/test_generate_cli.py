"""`fewbits generate`: bad options are refused with a one-line reason before any model is loaded."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from fewbits.cli import main


@pytest.mark.parametrize(("args", "needle"), [
    (["--kv", "int9"], "int9"),
    (["--weights", "int4-g7x"], "int4-g7x"),
    (["--device", "tpu"], "tpu"),
    (["-n", "0"], "0"),
])
def test_bad_options_are_refused(args: list[str], needle: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import fewbits.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded a model despite bad options"))
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_listed_with_the_commands() -> None:
    res = CliRunner().invoke(main, ["generate", "--help"])
    assert res.exit_code == 0 and "--eager" in res.output and "compiled" in res.output
