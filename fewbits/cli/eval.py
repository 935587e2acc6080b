"""`fewbits eval OUT --ref MODEL`: quality of a saved quantised model against the unquantised one."""

from __future__ import annotations

import os
import time

import click

from fewbits.cli.quantize import DTYPES


@click.command("eval")
@click.argument("quantized", type=click.Path())
@click.option("--ref", default=None,
              help="reference model (packaged name or directory); default: the model it was made from")
@click.option("--text", "text_files", multiple=True, type=click.Path(dir_okay=False),
              help="text file to evaluate on (repeatable); default: the packaged evaluation texts")
@click.option("--name", "names", multiple=True, help="category name for each --text (default: the file stem)")
@click.option("--seq-len", type=click.IntRange(2), default=512, show_default=True, help="tokens per window")
@click.option("--windows", type=click.IntRange(0), default=4, show_default=True,
              help="windows per text category (0 = all; of a --text file at most 1024, read in pieces)")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
              help="dtype of the reference run")
@click.option("--kernel", type=click.Choice(["cached", "reference", "auto", "auto-a8"]), default="cached",
              show_default=True,
              help="matmul of the quantised layers: the exact dequantised weights, dequantised once (cached) "
                   "or on every call (reference), or the fast kernel dispatcher (auto: bf16 activations on "
                   "the CPU's int4/int8 paths; what fewbits.api.load_quantized_model gives by default; auto-a8: "
                   "activations rounded to int8 where a kernel can, as llama.cpp's CPU paths do)")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None, help="write results as JSON")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None,
              help="write a plot (PNG) of this run's KL per kind of text (mean and 99th percentile); "
                   "`fewbits demo` plots KL against bits per weight over many formats")
@click.option("--quiet", is_flag=True, help="no progress bars")
def eval_cmd(quantized: str, ref: str | None, text_files: tuple[str, ...], names: tuple[str, ...], seq_len: int,
             windows: int, dtype: str, kernel: str, json_out: str | None, plot_out: str | None, quiet: bool) -> None:
    """Perplexity, KL(ref || quant) mean and 99th percentile, top-1 agreement, per text category
    (causal models), or sentence-embedding cosine (encoders), against the reference model.

    QUANTIZED: a directory fewbits saved, a GGUF file (any type gguf-py reads), or a compressed-tensors,
    GPTQ or AWQ directory (these need --ref)."""
    from fewbits import api
    from fewbits.eval import report as R
    from fewbits.eval import run
    from fewbits.eval.perplexity import compare
    from fewbits.files import check_output
    from fewbits.models.loading import load_model
    from fewbits.models.swap import model_nbytes

    t0 = time.perf_counter()
    for out in (json_out, plot_out):
        if out and not os.path.isdir(os.path.dirname(out) or "."):
            raise click.BadParameter(f"{out}: folder {os.path.dirname(out)} does not exist")
    try:
        if names and len(names) != len(text_files):
            raise ValueError(f"{len(names)} --name given for {len(text_files)} --text files")
        for target in (json_out, plot_out):  # an unwritable output fails now, not after the evaluation
            if target:
                check_output(target, overwrite=True, kind="file")
        texts = run.eval_texts(text_files, names)
        model, tok, info = api.load_checkpoint(quantized, chooser=api.kernel_chooser(kernel))
        ref_name = ref or info.get("source")
        if not ref_name:
            raise ValueError(f"{quantized} does not record the model it was made from; pass --ref MODEL")
        ref_model, ref_tok = load_model(ref_name, dtype=dtype)
        fmt, method, bpw, size = info["format"], info["method"], info["bits_per_weight"], info["size_bytes"]
        if run.is_causal_lm(model):
            wins, protocol = run.causal_windows(ref_tok, texts, seq_len, windows or None)
            cmp = compare(model.to(ref_model.dtype), ref_model, wins, progress=not quiet)
            row = run.result_row(method, fmt, bpw, size, model_nbytes(ref_model), cmp)
            click.echo(protocol.text())
            click.echo(f"reference: {ref_name} ({dtype}); quantised: {quantized}")
            click.echo(R.table_text([row], {"format": dtype, "bits_per_weight": 32.0 if dtype == "fp32" else 16.0,
                                            "size_bytes": model_nbytes(ref_model),
                                            "overall": {"ppl": cmp["overall"]["ref_ppl"]}}))
            results = {"protocol": protocol.to_dict(), "reference": ref_name, "rows": [row]}
        else:
            cmp = run.compare_encoder(model.to(ref_model.dtype), ref_model, ref_tok, texts)
            row = run.result_row(method, fmt, bpw, size, model_nbytes(ref_model), cmp)
            click.echo(f"encoder: cosine of mean-pooled sentence embeddings to {ref_name} ({dtype})")
            click.echo(run.encoder_table([row]))
            results = {"protocol": {"encoder_cosine": True}, "reference": ref_name, "rows": [row]}
        if json_out:
            R.write_json(json_out, results)
        if plot_out:
            if not run.is_causal_lm(model):
                raise ValueError("--plot draws KL against bits per weight; an encoder has no KL")
            R.plot_kl_by_category(row, plot_out, title=f"{quantized} against {ref_name}: KL per kind of text")
    except (ValueError, FileNotFoundError, OSError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"done in {time.perf_counter() - t0:.1f} s")

