"""`fewbits plan` from the command line, and the promise that the cost path never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from fewbits.cli import main

DATA = Path(__file__).parents[1] / "models" / "data"
SEED16 = ["plan", "--model", "llama-3-8b", "--device", "h100", "--batch", "16", "--context", "4096",
          "--profile", "seed"]


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_text_report_has_breakdown_fit_and_table() -> None:
    r = _run(*SEED16, "--table-weights", "bf16,int8,int4")
    assert r.exit_code == 0, r.output
    out = r.output
    assert "decode step 9.307 ms, 1719 tok/s, memory-bound" in out
    assert "16.06 GB of weights + 8.59 GB of cache = 24.65 GB of 80 GB" in out and "fits" in out
    assert "beyond 114,513 cached tokens" in out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith(("bf16 ", "int8 ", "int4 "))]
    assert [(x[0], x[1], x[2]) for x in rows] == [
        ("bf16", "bf16", "9.307"), ("bf16", "fp8-e4m3", "7.704"), ("int8", "bf16", "6.506"),
        ("int8", "fp8-e4m3", "4.903"), ("int4", "bf16", "5.106"), ("int4", "fp8-e4m3", "3.503")]


def test_json_output() -> None:
    r = _run(*SEED16, "--weights", "int4-g128", "--kv", "fp8-e4m3", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["weights"] == "int4-g128" and d["kv"] == "fp8-e4m3" and d["fits"] is True
    assert {(t["weights"], t["kv"]) for t in d["table"]} >= {("int4-g128", "fp8-e4m3"), ("bf16", "bf16")}
    assert d["kv_bits_per_value"] == 8 and d["bound"] == "memory"


def test_sweep_and_config_path(tmp_path: Path) -> None:
    r = _run("plan", "--model", str(DATA / "smollm2_135m_config.json"), "--device", "l4", "--json", "--sweep",
             "batch=1,64", "context=128,8192")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["model"] == "smollm2_135m_config" and len(d["sweep"]["time_s"]) == 2
    assert any("outweighs" in s for s in d["sweep"]["summary"])
    r = _run("plan", "--model", "llama-3-8b", "--sweep", "batch=2,4")
    assert r.exit_code == 0 and "batch 4: the cache outweighs the weights" in r.output


def test_plot_svg(tmp_path: Path) -> None:
    out = tmp_path / "bars.svg"
    r = _run(*SEED16, "--plot", str(out))
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bars.svg"]


def test_clear_errors() -> None:
    cases = [
        (("--batch", "0"), "--batch"),
        (("--context", "-5"), "--context"),
        (("--weights", "int9"), "integer formats take 2..8 bits"),
        (("--weights", "int4-g100"), "not divisible by the group size 100"),
        (("--kv", "fp7"), "unknown format 'fp7'"),
        (("--device", "h1000"), "did you mean"),
        (("--profile", "nope.json"), "neither built in"),
        (("--plot", "x.pdf"), ".png or .svg"),
        (("batch=1,2",), "did you mean --sweep"),
        (("--sweep", "batch=0"), "positive"),
        (("--sweep", "depth=3"), "batch=1,8,32"),
    ]
    for extra, msg in cases:
        r = _run("plan", "--model", "llama-3-8b", *extra)
        assert r.exit_code != 0 and msg in r.output, (extra, r.output)
    r = _run("plan", "--model", "lama3-8b")
    assert r.exit_code == 1 and "did you mean llama-3-8b" in r.output
    r = _run("plan", "--model", "llama-3-70b", "--device", "l4")
    assert r.exit_code == 1 and "141.1 GB for its weights alone" in r.output and "at least 7 devices" in r.output


def test_cost_path_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "import fewbits.cost\n"
        "from fewbits.cli import main\n"
        "main(['plan', '--model', 'llama-3-8b', '--weights', 'int4-g128', '--json', '--sweep'],"
        " standalone_mode=False)\n"
        "bad = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["weights"] == "int4-g128"


def test_sweep_plot_draws_the_sweep(tmp_path: Path) -> None:
    """--sweep --plot draws every swept point (one line per context over the batches), not the base point."""
    from fewbits.cli.plan import sweep_figure
    from fewbits.cost.plan import plan

    out = tmp_path / "sweep.png"
    r = _run("plan", "--model", "smollm2-135m", "--json", "--sweep", "batch=1,8,32", "context=1024,8192",
             "--plot", str(out))
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 10_000
    data = json.loads(r.output)["sweep"]
    fig = sweep_figure(data, plan("smollm2-135m"))
    tps, ms = fig.axes
    lines = tps.get_lines()
    assert [list(ln.get_xdata()) for ln in lines] == [[1, 8, 32]] * 2
    assert [list(ln.get_ydata()) for ln in lines] == [[row[c] for row in data["tokens_per_s"]] for c in (0, 1)]
    assert len(ms.get_lines()) == 2
