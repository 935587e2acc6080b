"""Result table, JSON, plot and markdown report."""

from __future__ import annotations

import json

from fewbits.eval.report import _lower_front, markdown_report, plot_kl_vs_bits, table_text, write_json


def row(fmt, bits, kl, method="rtn"):
    o = {"ppl": 10 + kl, "ref_ppl": 10.0, "delta_ppl": kl, "kl_mean": kl, "kl_p99": 5 * kl, "top1": 0.9,
         "tokens": 100, "windows": 1}
    return {"method": method, "format": fmt, "bits_per_weight": bits, "size_bytes": 1_000_000,
            "ref_size_bytes": 2_000_000, "overall": o, "categories": {"code": o, "verse": o}}


ROWS = [row("int8", 8.02, 0.004), row("int4-g64", 4.25, 0.5), row("nf4-g64", 4.25, 0.25), row("int3-g64", 3.25, 2.4)]


def test_table_lists_every_row_and_category():
    t = table_text(ROWS, {"format": "bf16", "size_bytes": 2_000_000, "overall": {"ppl": 10.0}})
    lines = t.splitlines()
    assert "KL code" in lines[0] and "KL verse" in lines[0]
    assert lines[2].startswith("ref") and len(lines) == 2 + 1 + 4
    assert "0.00400" in lines[3] and "90.0%" in lines[3] and "+0.004" in lines[3]


def test_lower_front_keeps_best_per_size():
    pts = [(r["bits_per_weight"], r["overall"]["kl_mean"], r["format"]) for r in ROWS]
    assert [p[2] for p in _lower_front(pts)] == ["int3-g64", "nf4-g64", "int8"]


def test_json_plot_markdown(tmp_path):
    write_json(tmp_path / "r.json", {"rows": ROWS})
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["version"] == 1 and d["rows"][1]["format"] == "int4-g64"
    plot_kl_vs_bits(ROWS + [row("int4-g64", 4.25, 0.1, "gptq")], tmp_path / "p.png", "t")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.png", "r.json"]  # no temporary files left
    md = markdown_report("T", [("Plan", "x")], "TABLE", "p.png", "protocol: ...", ["a note"])
    assert "# T" in md and "TABLE" in md and "![KL against bits per weight](p.png)" in md and "- a note" in md


def test_one_run_plot_shows_kl_per_category(tmp_path) -> None:
    """`fewbits eval --plot` of one run: a bar per kind of text and overall, not a single dot."""
    from fewbits.eval.report import kl_by_category_figure, plot_kl_by_category

    row = {"method": "rtn", "format": "int4-g64", "bits_per_weight": 4.25,
           "overall": {"kl_mean": 0.05, "kl_p99": 0.4},
           "categories": {"verse": {"kl_mean": 0.04, "kl_p99": 0.3}, "code": {"kl_mean": 0.07, "kl_p99": 0.6}}}
    fig = kl_by_category_figure(row)
    ax = fig.axes[0]
    assert [round(p.get_width(), 6) for p in ax.patches] == [0.04, 0.07, 0.05]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["verse", "code", "overall"]
    plot_kl_by_category(row, tmp_path / "kl.png")
    assert (tmp_path / "kl.png").stat().st_size > 5_000 and len(list(tmp_path.iterdir())) == 1
