"""Results as a plain-text table, JSON, a plot (KL against bits per weight) and a markdown report.

A result row is a plain dict:
    {"method": "rtn", "format": "int4-g64", "bits_per_weight": 4.25, "size_bytes": ..., "ref_size_bytes": ...,
     "overall": {ppl, ref_ppl, delta_ppl, kl_mean, kl_p99, top1, tokens, windows}, "categories": {cat: {...}}}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

REPORT_VERSION = 1


def _fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table_text(rows: Sequence[Mapping[str, Any]], ref_row: Mapping[str, Any] | None = None) -> str:
    """One line per result: size, perplexity, KL mean / p99, top-1, and KL per category."""
    cats = sorted({c for r in rows for c in r.get("categories", {})})
    head = (f"{'method':<8} {'format':<11} {'bits/w':>6} {'size MB':>8} {'ppl':>8} {'d ppl':>7} "
            f"{'KL mean':>8} {'KL p99':>7} {'top-1':>6}" + "".join(f" {'KL ' + c[:9]:>12}" for c in cats))
    lines = [head, "-" * len(head)]
    if ref_row is not None:
        o = ref_row["overall"]
        lines.append(f"{'ref':<8} {ref_row['format']:<11} {_fmt(ref_row.get('bits_per_weight'), '6.2f')} "
                     f"{ref_row['size_bytes'] / 1e6:8.1f} {o['ppl']:8.3f} {'':>7} {'0':>8} {'0':>7} {'100%':>6}"
                     + "".join(f" {'0':>12}" for _ in cats))
    for r in rows:
        o = r["overall"]
        per = "".join(f" {_fmt(r['categories'].get(c, {}).get('kl_mean'), '12.5f')}" for c in cats)
        lines.append(
            f"{r['method']:<8} {r['format']:<11} {_fmt(r.get('bits_per_weight'), '6.2f')} "
            f"{r['size_bytes'] / 1e6:8.1f} {o['ppl']:8.3f} {_fmt(o.get('delta_ppl'), '+7.3f')} "
            f"{_fmt(o.get('kl_mean'), '8.5f')} {_fmt(o.get('kl_p99'), '7.4f')} "
            f"{_fmt(100 * o['top1'] if 'top1' in o else None, '5.1f')}%" + per)
    return "\n".join(lines)


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> None:
    """Write to a temporary file beside `path`, then rename it over `path`."""
    from fewbits.files import write_bytes

    write_bytes(path, data.encode() if isinstance(data, str) else data)  # fewbits.files: the one writer


def write_json(path: str | os.PathLike[str], results: Mapping[str, Any]) -> None:
    write_atomic(path, json.dumps({"version": REPORT_VERSION, **results}, indent=2, default=float))


def plot_kl_vs_bits(rows: Sequence[Mapping[str, Any]], path: str | os.PathLike[str], title: str = "") -> None:
    """Mean KL(ref || quant) against bits per weight, log scale, one line per method."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    ax = fig.add_subplot()
    methods: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        methods.setdefault(r["method"], []).append(r)
    for m, rs in methods.items():
        pts = sorted((r["bits_per_weight"], max(r["overall"]["kl_mean"], 1e-6), r["format"]) for r in rs)
        line = ax.scatter([p[0] for p in pts], [p[1] for p in pts], zorder=3)
        front = _lower_front(pts)  # the best this method reaches at each size
        ax.plot([p[0] for p in front], [p[1] for p in front], color=line.get_facecolor()[0], label=m)
        for x, y, name in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (quantised linear layers, scales included)")
    ax.set_ylabel("mean KL(ref || quant) per token [nats]")
    ax.set_title(title or "Quality against size")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    from fewbits.files import write_file

    write_file(path, lambda tmp: fig.savefig(tmp, format=Path(path).suffix.lstrip(".").lower() or "png"), True)


def kl_by_category_figure(row: Mapping[str, Any], title: str = "") -> Any:
    """One run's quality per kind of text: mean KL (bars) and 99th-percentile KL (ticks), overall last.
    (One run is one point on the KL-against-bits plot; per category it says where the error lies.)"""
    import matplotlib

    matplotlib.use("Agg", force=False)
    from matplotlib.figure import Figure

    cats = {**dict(row.get("categories", {})), "overall": row["overall"]}
    names = list(cats)
    means = [max(float(cats[c]["kl_mean"]), 1e-6) for c in names]
    p99 = [max(float(cats[c].get("kl_p99") or 0.0), 1e-6) for c in names]
    fig = Figure(figsize=(6.4, 0.5 * len(names) + 1.8))
    ax = fig.add_subplot()
    y = list(range(len(names)))
    ax.barh(y, means, color=["#3b6fd4"] * (len(names) - 1) + ["#444"], label="mean KL")
    ax.scatter(p99, y, marker="|", s=200, color="#c44", zorder=3, label="99th percentile KL")
    for yi, m in zip(y, means, strict=True):
        ax.annotate(f" {m:.4f}", (m, yi), va="center", fontsize=8)
    ax.set_yticks(y, names)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("KL(ref || quant) per token [nats], log scale")
    bpw = row.get("bits_per_weight")
    ax.set_title(title or f"{row['method']} {row['format']}" + (f" ({bpw:.2f} bits/weight)" if bpw else ""))
    ax.grid(True, axis="x", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def plot_kl_by_category(row: Mapping[str, Any], path: str | os.PathLike[str], title: str = "") -> None:
    """`kl_by_category_figure` written to `path` (temporary file, then rename)."""
    fig = kl_by_category_figure(row, title)
    from fewbits.files import write_file

    p = Path(path)
    write_file(p, lambda tmp: fig.savefig(tmp, format=p.suffix.lstrip(".").lower() or "png"), True)


def _lower_front(pts: Sequence[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Points (bits, kl, name) sorted by bits where no point with fewer or equal bits has lower KL."""
    front: list[tuple[float, float, str]] = []
    for p in sorted(pts):
        if front and p[0] == front[-1][0]:
            if p[1] < front[-1][1]:
                front[-1] = p
            continue
        if not front or p[1] < front[-1][1]:
            front.append(p)
    return front


def markdown_report(title: str, sections: Sequence[tuple[str, str]], table: str, plot_name: str | None,
                    protocol: str, notes: Sequence[str] = ()) -> str:
    """A markdown document: free sections (heading, body), the result table, the plot and notes."""
    out = [f"# {title}", ""]
    for head, body in sections:
        out += [f"## {head}", "", "```", body.rstrip(), "```", ""]
    out += ["## Quality against the unquantised model", "", protocol, "", "```", table, "```", ""]
    if plot_name:
        out += [f"![KL against bits per weight]({plot_name})", ""]
    if notes:
        out += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(out)
