"""One typed config per method and one registry entry per method: fields, defaults, formats, errors."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from fewbits.formats.format import parse_format
from fewbits.methods import config as C
from fewbits.methods.registry import METHODS, config_for, resolve


def test_every_method_has_its_own_config_named_after_it():
    for name, entry in METHODS.items():
        assert entry.config.method == name
    assert len({e.config for e in METHODS.values()}) == len(METHODS)
    assert {n for n, e in METHODS.items() if e.needs_data} == {"gptq", "awq", "awq+gptq", "smoothquant"}


def test_defaults_match_the_maths_functions_they_feed():
    """The keyword defaults of the pure functions are the configs' defaults: one default per option (act_order
    used to be False in gptq_quantize and True in the calibration pipeline)."""
    from fewbits.methods.awq import awq_search_scales
    from fewbits.methods.gptq import gptq_quantize
    from fewbits.methods.hqq import hqq_quantize
    from fewbits.methods.smoothquant import smooth_scales

    def defaults(fn):
        return {k: p.default for k, p in inspect.signature(fn).parameters.items() if p.default is not p.empty}

    g = defaults(gptq_quantize)
    assert C.GPTQ().gptq_kwargs() == {k: g[k] for k in ("damp", "act_order", "block_size", "static_groups")}
    assert C.GPTQ().act_order is True
    h = defaults(hqq_quantize)
    assert (h["iters"], h["p"], h["beta"], h["kappa"]) == (C.HQQ.iters, C.HQQ.p, C.HQQ.beta, C.HQQ.kappa)
    assert defaults(awq_search_scales)["n_grid"] == C.AWQ.grid
    assert defaults(smooth_scales)["alpha"] == C.SmoothQuant.alpha


def test_unknown_and_mistyped_options_name_themselves_and_the_valid_ones():
    with pytest.raises(C.MethodConfigError, match=r"method gptq has no option 'dampp'; its options are act_order, "
                                                   r"block_size, damp, expert_min_tokens, static_groups"):
        config_for("gptq", {"dampp": 0.1})
    with pytest.raises(C.MethodConfigError, match=r"no options 'a', 'b'"):
        config_for("hqq", {"a": 1, "b": 2})
    with pytest.raises(C.MethodConfigError, match="unknown method 'gtpq'"):
        config_for("gtpq")
    with pytest.raises(C.MethodConfigError, match=r"option damp must be a number, got True"):
        C.GPTQ(damp=True)
    with pytest.raises(C.MethodConfigError, match=r"option damp must be at least 0.0"):
        C.GPTQ(damp=-0.1)
    with pytest.raises(C.MethodConfigError, match=r"option block_size must be at least 1"):
        C.GPTQ(block_size=0)
    with pytest.raises(C.MethodConfigError, match=r"act_bits must be 2..8"):
        C.SmoothQuant(act_bits=16)
    with pytest.raises(TypeError):
        C.GPTQ(act_ordr=True)  # the dataclass itself refuses a misspelled keyword
    assert C.GPTQ(damp=1).damp == 1.0 and isinstance(C.GPTQ(damp=1).damp, float)  # an int is a number


def test_configs_are_frozen_and_round_trip():
    cfg = C.AWQGPTQ(damp=0.05, grid=10)
    with pytest.raises(AttributeError):
        cfg.damp = 0.1  # type: ignore[misc]
    assert cfg.options() == {"damp": 0.05, "grid": 10}
    assert config_for("awq+gptq", cfg.options()) == cfg
    d = cfg.to_dict()
    assert d["method"] == "awq+gptq" and d["act_order"] is True and d["search_tokens"] == 512
    assert resolve(cfg) == ("awq+gptq", cfg) and resolve("hqq", {"iters": 5}) == ("hqq", C.HQQ(iters=5))
    with pytest.raises(C.MethodConfigError, match="not the config of a registered method"):
        resolve(C.MethodConfig())


@pytest.mark.parametrize("method, spec, ok", [
    ("rtn", "nf4-g64", True), ("gptq", "int4-g64", True), ("gptq", "nf4-g64", False),
    ("gptq", "int4-g64-asym-zfp16", False), ("hqq", "int4-g64-asym-zfp16", True), ("awq", "int4-g64-asym-zfp16", True),
    ("smoothquant", "int8", True), ("smoothquant", "int8-g64", False), ("llm-int8", "int4", False),
    ("rtn", "bf16", False),
])
def test_each_config_says_which_formats_it_takes(method, spec, ok):
    problem = METHODS[method].config().format_problem(parse_format(spec), method)
    assert (problem is None) == ok
    if not ok:
        assert method in problem and spec.split("-z")[0] in problem


def test_registry_and_configs_load_without_torch():
    code = ("import sys; import fewbits.methods.registry, fewbits.models.recipe, fewbits.cli.quantize; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
