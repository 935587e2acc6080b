import pytest

from fewbits.formats.format import EXAMPLE_SPECS, Format, FormatError, parse_format


@pytest.mark.parametrize("spec", EXAMPLE_SPECS)
def test_spec_round_trips(spec):
    fmt = parse_format(spec)
    assert fmt.spec == spec
    assert parse_format(fmt.spec) == fmt
    assert Format.from_dict(fmt.to_dict()) == fmt


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("suffix", ["", "-t", "-g32", "-g128", "-asym", "-g64-asym", "-t-asym", "-g128-sfp32"])
def test_every_int_spelling_round_trips(bits, suffix):
    spec = f"int{bits}{suffix}"
    assert parse_format(spec).spec == spec


@pytest.mark.parametrize(
    "spec, bpw",
    [("int4-g128", 4.125), ("int4-g32", 4.5), ("nvfp4", 4.5), ("mxfp4", 4.25), ("mxfp8", 8.25),
     ("int8-g128", 8.125), ("nf4-g64", 4.25), ("fp4-g32", 4.5), ("bf16", 16.0), ("int3-g64", 3.25),
     ("int4-g128-asym", 4.0 + 16 / 128 + 4 / 128)],
)
def test_bits_per_weight_counts_scales_and_zeros(spec, bpw):
    assert parse_format(spec).bits_per_weight() == pytest.approx(bpw)


def test_bits_per_weight_with_shape_is_exact():
    # per-channel int8 on 4096x4096: 8 bits + one fp16 scale per row of 4096
    assert parse_format("int8").bits_per_weight((4096, 4096)) == 8 + 16 / 4096
    # nvfp4 adds one fp32 tensor scale
    assert parse_format("nvfp4").storage_bits((16, 64)) == 16 * 64 * 4 + 16 * 4 * 8 + 32
    # odd widths pad each row to whole bytes: 3-bit rows of 10 codes -> 4 bytes
    assert parse_format("int3-g10").storage_bits((2, 10)) == 2 * 32 + 2 * 16


def test_semantics():
    f = parse_format("int4-g64-asym")
    assert (f.kind, f.bits, f.granularity, f.group_size, f.symmetric) == ("int", 4, "group", 64, False)
    assert parse_format("fp8-e4m3").scale_dtype == "fp32"
    assert parse_format("int8-t").granularity == "tensor"
    assert parse_format("FP8-E5M2").element == "e5m2"


@pytest.mark.parametrize("bad", ["int9", "int1", "int4-g0", "fp4", "nf4-t", "fp8-e4m3-asym", "int4-g64-g32",
                                 "int4-q", "", "float7", "int4-t-g32", "int4-g64-wide"])
def test_bad_specs_raise_clear_errors(bad):
    with pytest.raises(FormatError, match="format|spec"):
        parse_format(bad)


def test_unknown_spec_suggests_close_names():
    with pytest.raises(FormatError, match="int4-g128"):
        parse_format("innt4-g128")


def test_shape_errors_name_tensor_shape_and_format():
    with pytest.raises(FormatError, match=r"q_proj.*\(576, 576\).*int4-g128"):
        parse_format("int4-g128").check_shape((576, 576), "q_proj")
    with pytest.raises(FormatError, match="empty"):
        parse_format("int8").check_shape((0, 16), "w")


def test_metadata_version_is_checked():
    d = parse_format("int4-g128").to_dict()
    d["version"] = 99
    with pytest.raises(FormatError, match="version"):
        Format.from_dict(d)
    d = parse_format("int4-g128").to_dict()
    d["group_size"] = 64
    with pytest.raises(FormatError, match="inconsistent"):
        Format.from_dict(d)


def test_format_module_does_not_need_torch():
    import subprocess
    import sys

    code = "import sys, fewbits.formats.format as f; f.parse_format('int4-g128'); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("suffix", ["", "-t", "-g32", "-g128-sfp32"])
def test_the_grid_spellings(bits, suffix):
    full, narrow = parse_format(f"int{bits}{suffix}"), parse_format(f"int{bits}{suffix}-narrow")
    assert (full.grid, narrow.grid) == ("full", "narrow")
    assert parse_format(f"int{bits}-full{suffix}") == full  # -full is the default, spelled or not
    assert narrow.spec == f"int{bits}{suffix.replace('-sfp32', '')}-narrow" + ("-sfp32" if "sfp32" in suffix else "")
    # codes -2^(b-1)..2^(b-1)-1 against -L..L: one more level, the same storage
    assert (full.qmin, full.qmax) == (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
    assert (narrow.qmin, narrow.qmax) == (-(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1)
    assert full.bits_per_weight((64, 256)) == narrow.bits_per_weight((64, 256))


@pytest.mark.parametrize("bad,why", [("int4-g64-asym-narrow", "asym"), ("int4-asym-full", "asym"),
                                     ("nf4-g64-narrow", "nf4"), ("fp8-e4m3-full", "fp8"),
                                     ("int4-narrow-full", "cannot read"), ("int4-narrow-narrow", "cannot read")])
def test_the_grid_belongs_to_symmetric_integers(bad, why):
    with pytest.raises(FormatError, match=why):
        parse_format(bad)
    with pytest.raises(FormatError, match="symmetric integer"):
        Format("int", 4, "group", 64, symmetric=False, grid="narrow")
    with pytest.raises(FormatError, match="unknown grid"):
        Format("int", 4, grid="wide")


def test_metadata_of_the_grid_and_of_formats_saved_before_it():
    d = parse_format("int4-g64").to_dict()
    assert (d["version"], d["grid"], d["spec"]) == (3, "full", "int4-g64")
    assert parse_format("int4-g64-narrow").to_dict()["grid"] == "narrow"
    assert "grid" not in parse_format("int4-g64-asym").to_dict()  # formats without a grid keep version 1
    assert parse_format("int4-g64-asym").to_dict()["version"] == 1
    # a symmetric integer format saved before the full grid: version 1, no grid, spelled without -narrow
    old = {"version": 1, "spec": "int4-g64", "kind": "int", "bits": 4, "granularity": "group", "group_size": 64,
           "symmetric": True, "scale_dtype": "fp16", "element": "int", "tensor_scale": False}
    fmt = Format.from_dict(old)
    assert fmt.grid == "narrow" and fmt.spec == "int4-g64-narrow" and fmt == parse_format("int4-g64-narrow")
    assert Format.from_dict({**old, "version": 2}).grid == "narrow"
    with pytest.raises(FormatError, match="inconsistent"):
        Format.from_dict({**old, "spec": "int4-g64-narrow"})  # no file of that time spelled it so
    with pytest.raises(FormatError, match="version 1 cannot carry 'grid'"):
        Format.from_dict({**old, "grid": "full"})
    assert Format.from_dict({**old, "version": 3, "grid": "full"}) == parse_format("int4-g64")
