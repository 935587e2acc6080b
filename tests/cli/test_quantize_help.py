"""`fewbits quantize --help` lists the methods (the same as fewbits.api.METHODS); a misfit error is short."""

from __future__ import annotations

from click.testing import CliRunner

from fewbits import api
from fewbits.cli import main
from fewbits.cli.quantize import METHOD_NAMES
from fewbits.models.recipe import Recipe, RecipeError


def test_method_help_lists_every_method() -> None:
    assert list(METHOD_NAMES) == list(api.METHODS)
    r = CliRunner().invoke(main, ["quantize", "--help"])
    assert r.exit_code == 0
    flat = " ".join(r.output.split())
    assert all(m in flat for m in METHOD_NAMES)
    bad = CliRunner().invoke(main, ["quantize", "smollm2-135m", "--format", "int8", "--method", "gptx", "-o", "x"])
    assert bad.exit_code == 2 and "'gptx' is not one of" in bad.output


def test_misfit_error_is_one_line_per_kind_of_layer() -> None:
    """SmolLM2-135M in int4-g128: 180 layers of 6 kinds (576 inputs) do not fit; 7 lines, not 181."""
    shapes = []
    for b in range(30):
        for name, shape in (("self_attn.q_proj", (576, 576)), ("self_attn.k_proj", (192, 576)),
                            ("self_attn.v_proj", (192, 576)), ("self_attn.o_proj", (576, 576)),
                            ("mlp.gate_proj", (1536, 576)), ("mlp.up_proj", (1536, 576)),
                            ("mlp.down_proj", (576, 1536))):
            shapes.append((f"model.layers.{b}.{name}", shape))
    try:
        Recipe.from_format("int4-g128").plan(shapes)
    except RecipeError as e:
        lines = str(e).splitlines()
    else:
        raise AssertionError("a misfit must be an error by default")
    assert lines[0].startswith("180 layer(s) do not fit") and len(lines) == 7
    assert "model.layers.0.mlp.up_proj: last dimension 576" in lines[6]
    assert "29 more model.layers.*.mlp.up_proj" in lines[6]


def test_demo_cost_section_says_why_h100_and_why_small_speedups() -> None:
    """The parts the explanation names add up to the step (overhead + attention + linear layers), and the
    same formats on a model whose weights dominate its step gain more."""
    import re

    from fewbits.cli.demo import cost_plan_text
    from fewbits.cost.plan import plan

    text = cost_plan_text("smollm2-135m", ["int8", "int4-g64"])
    assert "Modelled on the NVIDIA H100" in text and "default device" in text and "fewbits probe" in text
    r = plan("smollm2-135m")
    assert abs(r.overhead_s + r.t_attention_s + r.t_linear_s - r.time_s) < 1e-9  # a step is those three here
    m = re.search(r"of the ([\d.]+) ms 16-bit step, ([\d.]+) ms is fixed per-step overhead .* and ([\d.]+) ms "
                  r"attention .* linear layers' ([\d.]+) ms", text)
    assert m and abs(float(m[2]) + float(m[3]) + float(m[4]) - float(m[1])) < 2e-3
    small = re.search(r"int4-g64 +[\d.]+ ms +\d+ +([\d.]+)x", text)
    big = re.search(r"Llama-3-8B .*int4-g64 ([\d.]+)x", text)
    assert small and big and float(big[1]) > float(small[1]) + 0.2


def test_embedding_option_is_checked_before_any_work(tmp_path) -> None:
    """--embedding goes with --to gguf, in a type GGUF holds; both refused before a model is loaded."""
    out = tmp_path / "o"
    r = CliRunner().invoke(main, ["quantize", "no-such-model", "--format", "int4-g32", "--embedding", "q8_0",
                                  "-o", str(out)])
    assert r.exit_code == 2 and "--to gguf" in r.output
    r = CliRunner().invoke(main, ["quantize", "no-such-model", "--format", "int4-g32", "--to", "gguf",
                                  "--embedding", "int4-g64", "-o", str(out)])
    assert r.exit_code == 1 and "int4-g64" in r.output and "Traceback" not in r.output
    assert not out.exists()
