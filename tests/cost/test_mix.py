"""A mix's predicted step: per-layer terms checked by hand and against the step model's uniform figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from fewbits.cost.devices import get_device
from fewbits.cost.mix import layer_time, mixed_time, uniform_check, uniform_time
from fewbits.cost.profile import load_profile
from fewbits.models.spec import ModelSpec

SMOL = Path(__file__).parents[1] / "models" / "data" / "smollm2_135m_config.json"


def test_layer_time_by_hand() -> None:
    # int4-g64 on 576 x 576: 576*576/2 code bytes + 576*9 fp16 scales = 176,256 bytes, streamed at the
    # default profile's int4 efficiency 0.34 of the H100's 3.35 TB/s; no call overhead measured there
    t = layer_time("int4-g64", (576, 576), get_device("h100"), load_profile("default"))
    assert t == pytest.approx(176_256 / (3.35e12 * 0.34), rel=1e-12)


@pytest.mark.parametrize("profile", ["default", "seed"])
def test_additive_prediction_matches_the_step_model_for_uniform_formats(profile: str) -> None:
    spec = ModelSpec.from_hf_config(SMOL)
    dev = get_device("h100")
    out = uniform_check(spec, ["int3-g64", "int4-g64", "int8", "bf16"], "int3-g64", dev, load_profile(profile), 2048)
    for fmt, v in out.items():
        assert v["additive"] == pytest.approx(v["step_model"], rel=1e-6), fmt
    assert out["int3-g64"]["step_model"] < out["int8"]["step_model"] < out["bf16"]["step_model"]


def test_mixed_time_lies_between_its_uniform_ends() -> None:
    spec = ModelSpec.from_hf_config(SMOL)
    dev, prof = get_device("h100"), load_profile("default")
    shapes = [s.shape for s in spec.linear_shapes() if s.role not in ("lm_head", "router") for _ in range(s.count)]
    half = [(sh, "int8" if i % 2 else "int4-g64") for i, sh in enumerate(shapes)]
    t = mixed_time(spec, half, "int4-g64", dev, prof, 2048)
    assert uniform_time(spec, "int4-g64", dev, prof, 2048) < t < uniform_time(spec, "int8", dev, prof, 2048)
    assert mixed_time(spec, [(sh, "int8") for sh in shapes], "int4-g64", dev, prof, 2048) == pytest.approx(
        uniform_time(spec, "int8", dev, prof, 2048), rel=1e-9)
