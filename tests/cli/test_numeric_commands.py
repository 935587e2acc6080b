import json
import re
import subprocess
import sys

from click.testing import CliRunner

from fewbits.cli import main


def run(*args):
    res = CliRunner().invoke(main, list(args))
    return res


def test_layer_error_prints_the_reference_figures():
    res = run("layer-error")
    assert res.exit_code == 0, res.output
    errs = re.findall(r"error\s+([\d.]+)%", res.output)
    assert errs == ["0.72", "14.76", "12.21", "10.17", "25.58", "0.96", "3.18", "0.73"]


def test_layer_error_takes_any_spec_and_json():
    res = run("layer-error", "--weights", "int4-g64,nf4-g64,mxfp4", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    names = [r["name"] for r in data["weight-only"]]
    assert names == ["int4-g64", "nf4-g64", "mxfp4"]
    assert all(0 < r["rel_error"] < 0.2 for r in data["weight-only"])


def test_layer_error_bad_inputs():
    res = run("layer-error", "--weights", "int4-g100")
    assert res.exit_code != 0 and "not divisible by the group size 100" in res.output
    res = run("layer-error", "--weights", "int12")
    assert res.exit_code != 0 and "int12" in res.output


def test_try_shows_zeros_from_an_outlier():
    plain = run("try", "--bits", "4")
    out = run("try", "--bits", "4", "--outlier")
    small = run("try", "--bits", "4", "--outlier", "--group", "8")
    zeros = [int(re.search(r"(\d+) of 64 weights became zero", r.output).group(1)) for r in (plain, out, small)]
    assert zeros[1] > zeros[0] and zeros[2] < zeros[1]
    assert "bits per weight: 6.000" in small.output  # 4 + 16/8
    assert "bits per weight: 4.250" in plain.output  # 4 + 16/64


def test_formats_lists_bits_per_weight():
    res = run("formats", "--shape", "4096x4096")
    assert res.exit_code == 0
    lines = {ln.split()[0]: float(ln.split()[1]) for ln in res.output.splitlines()[1:]}
    assert lines["int4-g128"] == 4.125 and lines["nvfp4"] == 4.5 and lines["mxfp4"] == 4.25
    assert run("formats", "int5-g8").exit_code == 0
    assert "not divisible" in run("formats", "int5-g7").output
    assert run("formats", "qint4").exit_code != 0


def test_every_subcommand_has_help():
    for name in main.list_commands(None):
        res = run(name, "--help")
        assert res.exit_code == 0 and "Usage" in res.output, name


def test_python_dash_m_works():
    out = subprocess.run([sys.executable, "-m", "fewbits", "--help"], capture_output=True, text=True, check=True)
    assert "layer-error" in out.stdout


def test_formats_lists_both_integer_grids_at_the_same_bits():
    res = run("formats", "int4-g64", "int4-g64-narrow", "int4-g64-asym")
    assert res.exit_code == 0, res.output
    rows = {ln.split()[0]: ln for ln in res.output.splitlines()[1:]}
    assert "-8..7" in rows["int4-g64"] and "-7..7" in rows["int4-g64-narrow"] and "0..15" in rows["int4-g64-asym"]
    assert float(rows["int4-g64"].split()[1]) == float(rows["int4-g64-narrow"].split()[1]) == 4.25


def test_try_and_layer_error_show_the_full_grid_on_request():
    narrow = run("try", "--bits", "4", "--group", "8")
    full = run("try", "--bits", "4", "--group", "8", "--full-grid")
    assert "format int4-g8-narrow" in narrow.output and "format int4-g8:" in full.output
    codes = [int(ln.split()[2]) for ln in full.output.splitlines()[2:66]]
    assert min(codes) == 0  # each group's extreme lands on the end code -8 (stored 0)
    res = run("layer-error", "--grid", "spec", "--weights", "int4-g32,int4-g32-narrow")
    errs = [float(e) for e in re.findall(r"error\s+([\d.]+)%", res.output)[:2]]
    assert errs[0] < errs[1] and errs[1] == 10.17  # the full grid beats the reference's 10.17% at int4-g32
