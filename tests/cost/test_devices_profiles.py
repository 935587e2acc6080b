"""Device table and profile files."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from fewbits.cost import (
    DEFAULT,
    DEVICES,
    SEED,
    DeviceError,
    DeviceSpec,
    ProfileError,
    format_family,
    get_device,
    load_profile,
    plan,
    save_profile,
)
from fewbits.formats.format import parse_format


def test_table_has_the_devices_with_dense_figures() -> None:
    for key in ("h100-sxm", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "b200", "mi300x", "l40s", "l4",
                "rtx4090", "cpu"):
        d = DEVICES[key]
        assert d.source and d.memory_bytes > 0 and d.bandwidth > 0 and d.link_bandwidth > 0
        for p, v in d.peak_flops.items():  # 8-bit units run at least as fast as 16-bit ones
            assert v >= d.peak_flops["bf16"] or p == "bf16"
    h100 = get_device("H100")
    assert (h100.peak_flops["bf16"], h100.peak_flops["fp8"], h100.bandwidth) == (989.4e12, 1978.9e12, 3.35e12)
    assert not get_device("a100").has("fp8") and get_device("a100").has("int8")
    assert get_device("b200").has("fp4") and get_device("h200").memory_bytes == 141e9
    assert get_device("mi300x").peak_flops["bf16"] == 1307.4e12


def test_unknown_device_suggests() -> None:
    with pytest.raises(DeviceError, match="did you mean h100-sxm"):
        get_device("h100-sx")


def test_format_families() -> None:
    fam = {s: format_family(parse_format(s)) for s in ("bf16", "fp8-e4m3", "mxfp8", "int8", "int8-g128",
                                                         "int4-g128", "int2-g64", "nf4-g64", "nvfp4")}
    assert fam == {"bf16": "float", "fp8-e4m3": "fp8", "mxfp8": "fp8", "int8": "int8", "int8-g128": "int8",
                   "int4-g128": "int4", "int2-g64": "int2", "nf4-g64": "fp4", "nvfp4": "fp4"}


def test_profile_json_round_trip(tmp_path: Path) -> None:
    dev = replace(get_device("h100"), key="this-box", name="measured H100", bandwidth=2.9e12)
    prof = replace(DEFAULT, name="measured", device=dev, measured={"host": "box", "stream_GBps": 2900})
    path = tmp_path / "p.json"
    save_profile(prof, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]  # no temporary left behind
    data = json.loads(path.read_text())
    assert data["schema"] == "fewbits.profile" and data["version"] == 1
    assert load_profile(path) == prof
    for builtin in (SEED, DEFAULT):
        save_profile(builtin, path)
        assert load_profile(path) == builtin


def test_measured_device_replaces_the_datasheet(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    slow = replace(get_device("h100"), key="this-box", name="this box", bandwidth=3.35e12 / 2)
    save_profile(replace(SEED, name="half", device=slow), path)
    base = plan("llama-3-8b", None, 1, 2048, profile="seed", table_weights=None)
    half = plan("llama-3-8b", None, 1, 2048, profile=str(path), table_weights=None)
    assert half.device == "this box"
    assert half.time_s - 0.5e-3 == pytest.approx(2 * (base.time_s - 0.5e-3), rel=1e-12)
    # an explicit table device still wins
    assert plan("llama-3-8b", "l4", 1, 2048, profile=str(path), table_weights=None).device == "NVIDIA L4 24GB"


def test_partial_profile_file_takes_defaults(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"schema": "fewbits.profile", "version": 1, "name": "mine",
                                "bandwidth_efficiency": {"int4": 0.5}, "overhead_s": 0.001}))
    p = load_profile(path)
    assert p.bw_eff("int4") == 0.5 and p.bw_eff("fp8") == DEFAULT.bw_eff("fp8") and p.overhead_s == 0.001


@pytest.mark.parametrize("data,match", [
    ({"version": 2, "name": "x"}, "version 2"),
    ({"version": 1, "name": "x", "speed": 1}, "unknown profile keys"),
    ({"version": 1}, "needs a 'name'"),
    ({"version": 1, "name": "x", "bandwidth_efficiency": {"float": 1.5}}, r"not in \(0, 1\]"),
    ({"version": 1, "name": "x", "compute_efficiency": {"int3": 0.5}}, "unknown family"),
    ({"version": 1, "name": "x", "weight_bytes": "rough"}, "exact' or 'ideal"),
    ({"version": 1, "name": "x", "device": {"key": "d"}}, "lacks the field"),
])
def test_bad_profiles(tmp_path: Path, data: dict, match: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises((ProfileError, DeviceError), match=match):
        load_profile(path)


def test_missing_profile() -> None:
    with pytest.raises(ProfileError, match="neither built in"):
        load_profile("fast")


def test_device_validation() -> None:
    with pytest.raises(DeviceError, match="bf16"):
        DeviceSpec("x", "x", 1e9, 1e9, {"fp8": 1e12})
    assert DeviceSpec.from_dict(get_device("l4").to_dict()) == get_device("l4")


def test_int8_activation_families_fall_back_to_their_weights_and_may_compute_past_the_16_bit_peak() -> None:
    """"int4+a8": int4 weights on kernels that round the activations to int8 (`fewbits bench --activations q8`);
    the cost model's int8 activations look it up, a profile without it gives the weight-only figures."""
    from fewbits.cost.profile import Profile

    assert format_family(parse_format("int4-g64"), "int8") == "int4+a8"
    assert format_family(parse_format("int4-g64")) == format_family(parse_format("int4-g64"), "bf16") == "int4"
    assert format_family(parse_format("bf16"), "int8") == "float"  # 16-bit weights: no such kernel
    tables = dict(kv_bandwidth_efficiency={"float": 0.8}, device=get_device("h100"), low_precision_compute=False)
    p = Profile(name="p", bandwidth_efficiency={"float": 0.8, "int4": 0.4, "int4+a8": 0.6},
                compute_efficiency={"float": 0.6, "int4": 0.5, "int4+a8": 1.6}, **tables)
    assert p.bw_eff("int4+a8") == 0.6 and p.compute_eff("int4+a8") == 1.6 and p.bw_eff("int8+a8") == 0.8
    spec = "smollm2-135m"
    a8, w4 = (plan(spec, batch=1, context=128, weights="int4-g64", kv="bf16", profile=p, activations=act,
                   table_weights=None, table_kv=None) for act in ("int8", "auto"))
    assert a8.time_s < w4.time_s  # the a8 kernels' measured rate
    plain = Profile(name="q", bandwidth_efficiency={"float": 0.8, "int4": 0.4},
                    compute_efficiency={"float": 0.6}, **tables)
    assert plan(spec, batch=1, context=128, weights="int4-g64", kv="bf16", profile=plain, activations="int8",
                table_weights=None, table_kv=None).time_s == pytest.approx(
        plan(spec, batch=1, context=128, weights="int4-g64", kv="bf16", profile=plain,
             table_weights=None, table_kv=None).time_s)
    with pytest.raises(ProfileError, match="not in"):  # only the int8-activation families may pass 1, to 4
        Profile(name="r", bandwidth_efficiency={"float": 0.8}, compute_efficiency={"float": 0.6, "int4": 1.6}, **tables)
    with pytest.raises(ProfileError, match="not in"):
        Profile(name="r", bandwidth_efficiency={"float": 0.8}, compute_efficiency={"float": 0.6, "int4+a8": 5.0},
                **tables)


def test_int2_is_its_own_family_and_falls_back_to_int4() -> None:
    from fewbits.cost.profile import DEFAULT, Profile, format_family
    from fewbits.formats.format import parse_format

    assert format_family(parse_format("int3-g64")) == format_family(parse_format("int4-g128")) == "int4"
    assert DEFAULT.bw_eff("int2") == DEFAULT.bw_eff("int4")  # not measured: the 4-bit figure
    p = Profile(name="p", bandwidth_efficiency={"float": 0.8, "int4": 0.5, "int2": 0.2},
                kv_bandwidth_efficiency={"float": 0.8}, compute_efficiency={"float": 0.6},
                kv_layer_overhead_s={"int4": 1e-4})
    assert p.bw_eff("int2") == 0.2 and p.kv_overhead("int2") == 1e-4 and p.kv_eff("int2") == 0.8
