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

    for f in ("load_model", "load_tokenizer"):
        monkeypatch.setattr(loading, f, lambda *a, **k: pytest.fail("loaded a model despite bad options"))
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", *args])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


def test_listed_with_the_commands() -> None:
    res = CliRunner().invoke(main, ["generate", "--help"])
    assert res.exit_code == 0 and "--eager" in res.output and "compiled" in res.output


def test_activations_reach_the_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """--activations q8 is passed to `load_quantized` (which lets the dispatcher pick the int8-activation kernels);
    an unknown value is refused before any model is loaded."""
    import fewbits.bench.decode as decode
    import fewbits.models.loading as loading

    seen: dict = {}

    def fake_load(*args, **kw):  # noqa: ANN002, ANN003, ANN202
        seen.update(kw)
        raise RuntimeError("stop after the kernel choice")

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: None)
    monkeypatch.setattr(decode, "load_quantized", fake_load)
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", "--weights", "int4-g32", "--activations", "q8"])
    assert seen.get("activations") == "q8", res.output
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", "--activations", "q4"])
    assert res.exit_code == 2 and "q4" in res.output


def test_prompt_as_argument_or_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompt is the second argument or --prompt (the default when neither); both at once is refused before
    any model is loaded."""
    import fewbits.models.loading as loading

    seen: list = []

    class Stop(Exception):
        pass

    def fake_tok(text: str, **kw):  # noqa: ANN003, ANN202
        seen.append(text)
        raise Stop

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: fake_tok)
    monkeypatch.setattr("fewbits.bench.decode.load_quantized", lambda *a, **k: (None, "dense"))
    for args, want in ((["Once upon a time"], "Once upon a time"), (["--prompt", "In 1850"], "In 1850"),
                       ([], "The history of the printing press")):
        res = CliRunner().invoke(main, ["generate", "smollm2-135m", *args])
        assert isinstance(res.exception, Stop), res.output
        assert seen[-1] == want
    n = len(seen)
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", "Once", "--prompt", "Twice"])
    assert res.exit_code == 2 and "not both" in res.output and len(seen) == n


@pytest.mark.parametrize(("flag", "eos"), [([], 2), (["--ignore-eos"], None)])
def test_ignore_eos_reaches_the_decode_loop(flag: list[str], eos: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tokenizer's end-of-text id stops the decode unless --ignore-eos (then every --new-tokens token is
    decoded, for speed runs at a set length)."""
    import torch

    import fewbits.decode.generate as dgen
    import fewbits.models.loading as loading

    class Stop(Exception):
        pass

    class Tok:
        eos_token_id = 2

        def __call__(self, text: str, **kw):  # noqa: ANN003, ANN204
            return type("Enc", (), {"input_ids": torch.tensor([[1, 5]])})()

    seen: dict = {}

    def fake_generate(model, ids, n, kv, eos_token_id):  # noqa: ANN001, ANN202
        seen.update(n=n, eos=eos_token_id)
        raise Stop

    monkeypatch.setattr(loading, "load_tokenizer", lambda *a, **k: Tok())
    monkeypatch.setattr("fewbits.bench.decode.load_quantized", lambda *a, **k: (None, "dense"))
    monkeypatch.setattr(dgen, "generate_static", fake_generate)
    res = CliRunner().invoke(main, ["generate", "smollm2-135m", "-n", "40", *flag])
    assert isinstance(res.exception, Stop), res.output
    assert seen == {"n": 40, "eos": eos}
