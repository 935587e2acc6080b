"""`fewbits demo`: the cost-model plan for SmolLM2-135M, then round-to-nearest at six formats, each
measured against the unquantised model; a table printed and a markdown report with a plot written."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import click

from fewbits.cli.quantize import DTYPES

DEMO_MODEL = "smollm2-135m"
DEMO_FORMATS = ("int8", "fp8-e4m3", "int4-g64", "int4-g32", "nf4-g64", "int3-g64")
NOTES = (
    "The packaged SmolLM2 weights were published already quantised (Q4_1: a 4-bit grid in groups of 32), "
    "so group-32 4-bit results on this model are flattering; the other groupings are the fair ones.",
    "KL(ref || quant) is the mean over every predicted token of the full-vocabulary divergence in nats; "
    "p99 is its 99th percentile; top-1 is how often both models rank the same next token first.",
    "Sizes are the true bytes of every parameter and packed buffer (tied weights once); bits/w counts "
    "the quantised linear layers only, scales and zero points included; embeddings stay 16-bit.",
)


def cost_plan_text(model: str, formats: tuple[str, ...] | list[str]) -> str:
    """The cost model's prediction for `model`: a decode step in 16-bit, then each format's step time,
    speed-up and weight bytes (on the cost model's default device)."""
    from fewbits.cost.plan import format_plan_text, plan

    r = plan(model, table_weights=("bf16", *formats), table_kv=("bf16",))
    lines = [f"Modelled on the {r.device}: the cost model's default device, a GPU that serving runs on, where "
             "decode speed is read from bytes moved; this machine's own figures come from `fewbits probe -o "
             "cpu.json` then `fewbits plan --profile cpu.json` (and `fewbits bench` measures them).", "",
             format_plan_text(r), "", f"{'weights':<12}{'step':>11}{'tok/s':>9}{'speed-up':>10}{'weights GB':>12}"]
    for t in r.table:
        lines.append(f"{t.weights:<12}{t.time_s * 1e3:>8.3f} ms{t.tokens_per_s:>9.0f}{t.speedup:>9.2f}x"
                     f"{t.weight_bytes / 1e9:>12.3f}")
    fixed = r.overhead_s + r.t_attention_s
    lines += ["", f"Why the speed-ups are small: of the {r.time_s * 1e3:.3f} ms 16-bit step, "
              f"{r.overhead_s * 1e3:.3f} ms is fixed per-step overhead (launches, synchronisation) and "
              f"{r.t_attention_s * 1e3:.3f} ms attention over the cache ({fixed / r.time_s:.0%} together); "
              "fewer weight bits shrink only the linear layers' "
              f"{r.t_linear_s * 1e3:.3f} ms. A model whose weights dominate its step gains more:"
              + _big_model_hint(formats)]
    return "\n".join(lines)


def _big_model_hint(formats: tuple[str, ...] | list[str]) -> str:
    """The same formats on Llama-3-8B (the cost model's speed-ups where the weights are most of the step)."""
    from fewbits.cost.plan import plan

    try:
        big = plan("llama-3-8b", table_weights=("bf16", *formats), table_kv=("bf16",), misfit="regroup")
    except ValueError:
        return " (no Llama-3-8B figures for these formats)"
    return " Llama-3-8B " + ", ".join(f"{t.weights} {t.speedup:.2f}x" for t in big.table if t.weights != "bf16") + "."


@click.command("demo")
@click.option("--model", default=DEMO_MODEL, show_default=True, help="packaged name or model directory")
@click.option("--formats", default=",".join(DEMO_FORMATS), show_default=True, help="comma-separated format specs")
@click.option("--seq-len", default=512, show_default=True, help="tokens per evaluation window")
@click.option("--windows", default=1, show_default=True, help="windows per text category")
@click.option("--dtype", type=click.Choice(DTYPES), default="bf16", show_default=True,
              help="dtype of the reference model and of every run")
@click.option("-o", "--output", "out", default="fewbits-demo", show_default=True, type=click.Path(file_okay=False),
              help="folder for report.md, results.json and kl_vs_bits.png")
@click.option("--quiet", is_flag=True, help="no progress bars")
def demo_cmd(model: str, formats: str, seq_len: int, windows: int, dtype: str, out: str, quiet: bool) -> None:
    """Plan, quantise and measure SmolLM2-135M in a few minutes on a laptop CPU."""
    from tqdm.auto import tqdm

    from fewbits import api
    from fewbits.eval import report as R
    from fewbits.eval import run
    from fewbits.eval.perplexity import compare, fill_reference_cache
    from fewbits.files import check_output
    from fewbits.models.loading import load_model
    from fewbits.models.recipe import Recipe
    from fewbits.models.swap import model_nbytes

    t0 = time.perf_counter()
    specs = [s.strip() for s in formats.split(",") if s.strip()]
    try:
        recipes = {s: Recipe.from_format(s) for s in specs}  # bad specs fail before any work
        for name in ("report.md", "results.json", "kl_vs_bits.png"):  # and an unwritable -o
            check_output(Path(out) / name, overwrite=True, kind="file")
        try:
            plan_text = cost_plan_text(model, specs)
        except (ValueError, KeyError, ImportError) as e:
            plan_text = f"(no cost-model plan for {model}: {e})"
        click.echo("== cost model: what the formats should buy ==\n" + plan_text + "\n")
        ref, tok = load_model(model, dtype=dtype)
        ref_bytes = model_nbytes(ref)
        texts = run.eval_texts()
        wins, protocol = run.causal_windows(tok, texts, seq_len, windows)
        click.echo(protocol.text())
        t1 = time.perf_counter()
        cache = fill_reference_cache(ref, wins, batch=3, progress=not quiet)
        ref_seconds = time.perf_counter() - t1
        rows = []
        for spec in tqdm(specs, desc="formats", disable=quiet):
            m = copy.deepcopy(ref)  # a fresh float model to quantise (faster than loading it again)
            rep = api.quantize(m, recipes[spec], progress=not quiet, chooser=api.kernel_chooser("cached"))
            t1 = time.perf_counter()
            cmp = compare(m, None, wins, batch=3, ref_cache=cache, progress=not quiet, desc=spec)
            rows.append(run.result_row("rtn", spec, rep.bits_per_weight, rep.size_after, ref_bytes, cmp,
                                       quantize_seconds=round(rep.seconds, 1),
                                       eval_seconds=round(time.perf_counter() - t1, 1)))
            del m
    except (ValueError, FileNotFoundError, OSError) as e:
        raise click.ClickException(str(e)) from None
    ref_row = {"format": dtype, "bits_per_weight": 16.0 if dtype != "fp32" else 32.0, "size_bytes": ref_bytes,
               "overall": {"ppl": rows[0]["overall"]["ref_ppl"]} if rows else {"ppl": float("nan")}}
    table = R.table_text(rows, ref_row)
    click.echo("\n== quality against the unquantised model ==\n" + table)
    o = Path(out)  # each file below is written whole (fewbits.files) and replaces only a regular file
    R.plot_kl_vs_bits(rows, o / "kl_vs_bits.png", title=f"{model}: round-to-nearest, KL against bits per weight")
    wall = time.perf_counter() - t0
    results = {"model": model, "dtype": dtype, "protocol": protocol.to_dict(), "reference_size_bytes": ref_bytes,
               "rows": rows, "reference_seconds": round(ref_seconds, 1), "wall_seconds": round(wall, 1)}
    R.write_json(o / "results.json", results)
    md = R.markdown_report(f"fewbits demo: {model}", [("Cost model", plan_text)], table, "kl_vs_bits.png",
                           protocol.text(), [*NOTES, f"wall time of this demo: {wall:.0f} s"])
    R.write_atomic(o / "report.md", md)
    click.echo(f"\nreport: {o / 'report.md'} (plot {o / 'kl_vs_bits.png'}, data {o / 'results.json'}); "
               f"wall time {wall:.0f} s")
