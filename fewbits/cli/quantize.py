"""`fewbits quantize MODEL --format SPEC -o OUT [--to compressed-tensors]`: quantise every linear layer and
save the model (fewbits' own layout, or a checkpoint vLLM loads)."""

from __future__ import annotations

import json
import time

import click

from fewbits.methods.registry import METHODS
from fewbits.models.recipe import MISFIT_POLICIES

DTYPES = ("fp32", "bf16", "fp16")
#: the methods of fewbits.api.METHODS (the registry is pure Python: `--help` lists them without torch)
METHOD_NAMES = tuple(METHODS)


def calibration_ids(tokenizer, seq_len: int, n_windows: int):  # noqa: ANN001, ANN201
    """Token ids (n_windows, seq_len) of the packaged calibration mix; kept for scripts that import it:
    `fewbits.api.calibration_data` is the library's function (and records where the windows came from)."""
    from fewbits.data.calibration import calibration_data

    return calibration_data(tokenizer, samples=n_windows, seq_len=seq_len).ids


@click.command("quantize")
@click.argument("model")
@click.option("--format", "fmt", default=None, help="format spec for every linear layer, e.g. int4-g64, int8, nf4-g64")
@click.option("--method", type=click.Choice(METHOD_NAMES), default="rtn", show_default=True,
              help="how codes are chosen: rtn (round-to-nearest, no data), gptq, awq, awq+gptq and smoothquant "
                   "(calibrated: --calib), hqq (no data), llm-int8 (int8 with 16-bit outlier inputs); options "
                   "other than the defaults go in a --recipe rule's options table")
@click.option("--recipe", "recipe_file", type=click.Path(dir_okay=False), default=None,
              help="recipe file (.toml or .json): per-layer formats/methods, ignore list, misfit policy")
@click.option("--lm-head", "lm_head", default=None,
              help="also quantise the output projection (RTN) to this format, e.g. int8; default: kept 16-bit")
@click.option("--misfit", type=click.Choice(MISFIT_POLICIES), default=None,
              help="layers the format does not fit: error (default), keep them 16-bit, or regroup")
@click.option("--dtype", type=click.Choice(DTYPES), default="fp32", show_default=True,
              help="dtype the model is loaded and run in")
@click.option("--calib", "calib_files", multiple=True, type=click.Path(), metavar="FILE",
              help="calibrate on this text file, or on every file in this folder (repeatable); default: the "
                   "packaged mix of verse, prose and code")
@click.option("--calib-samples", "--calib-windows", "calib_windows", type=click.IntRange(1), default=16,
              show_default=True, help="calibration samples (windows of --calib-seq-len tokens)")
@click.option("--calib-seq-len", type=click.IntRange(2), default=512, show_default=True,
              help="tokens per calibration sample")
@click.option("-o", "--output", "out", required=True, type=click.Path(file_okay=False), help="output directory")
@click.option("--to", "target", type=click.Choice(("fewbits", "compressed-tensors", "gguf")), default="fewbits",
              show_default=True, help="output layout: fewbits' own (reloads with every format and method), "
              "compressed-tensors (vLLM, transformers; integer formats and per-channel fp8-e4m3), or gguf "
              "(OUT/model.gguf for llama.cpp; Llama, Mistral, Qwen2, Gemma-3; q4_0 ... q6_k, int4/int5/int8-g32)")
@click.option("--embedding", "embedding", default=None, metavar="SPEC",
              help="with --to gguf: the token embedding (a tied model's head too) in this type, RTN, as llama.cpp's "
                   "mixes store it (q8_0, q6_k, ...); default: 16 bits")
@click.option("--budget", default=None,
              help="mixed precision: one format per layer from --candidates, least predicted KL within bpw=BITS "
                   "(bits per weight of the linears), size=BYTES (whole model, e.g. 1.2GB) or step-ms=MS (predicted "
                   "batch-1 decode step on --device); writes OUT/recipe.toml and OUT/budget.json too")
@click.option("--candidates", default=None,
              help="formats --budget chooses from, comma-separated (default int3-g64,int3-g32,int4-g64,int4-g32,"
                   "int5-g64,int5-g32,int6-g64,int8)")
@click.option("--device", default=None, help="cost-model device (e.g. h100) for --budget's predicted step time")
@click.option("--stream/--no-stream", "stream", default=None,
              help="read, quantise and write one decoder block at a time, for models bigger than memory (a model "
                   "directory of safetensors, fewbits layout); default: stream when the model would take more than "
                   "half the memory available")
@click.option("--overwrite", is_flag=True, help="replace OUT if it exists")
@click.option("--quiet", is_flag=True, help="no progress bars")
def quantize_cmd(model: str, fmt: str | None, method: str, recipe_file: str | None, lm_head: str | None,
                 misfit: str | None, calib_files: tuple[str, ...],
                 dtype: str, calib_windows: int, calib_seq_len: int, target: str, budget: str | None,
                 candidates: str | None, device: str | None, embedding: str | None, stream: bool | None, out: str,
                 overwrite: bool, quiet: bool) -> None:
    """Quantise MODEL (a packaged name such as smollm2-135m, or a model directory) and save it to OUT.

    OUT loads with fewbits.api.load_quantized_model on the fast kernels (the dispatcher) by default;
    `fewbits eval OUT` measures it on the exact dequantised weights (--kernel cached).  With
    --to compressed-tensors, OUT is a compressed-tensors checkpoint (vllm serve OUT; transformers'
    from_pretrained) instead."""
    from pathlib import Path

    from fewbits.files import check_output, write_dir

    try:
        check_output(out, overwrite)  # a used, foreign, read-only or too long OUT fails now, not after the work
    except OSError as e:
        raise click.ClickException(str(e)) from None
    from fewbits import api
    from fewbits.calib import distributed
    from fewbits.models.loading import load_model
    from fewbits.models.recipe import Recipe

    t0 = time.perf_counter()
    mix = None
    try:
        distributed.init_from_env()  # under torchrun: join the process group (the library never starts one)
        cands = [c.strip() for c in candidates.split(",") if c.strip()] if candidates else None
        if (candidates or device) and not budget:
            raise click.UsageError("--candidates and --device go with --budget")
        if budget:
            from fewbits.budgeted import DEFAULT_CANDIDATES, Budget

            if fmt or recipe_file or lm_head:
                raise click.UsageError("--budget chooses the formats: give it without --format, --recipe or --lm-head")
            bud = Budget.parse(budget)
            cands = cands or list(DEFAULT_CANDIDATES)
            recipe = Recipe.from_format(cands[0], method)  # stands in until the mix is chosen (checks below)
            from fewbits.calib.sensitivity import check_budget_method

            check_budget_method(method, cands)  # before any work
        elif recipe_file:
            recipe = Recipe.load(recipe_file)
            if fmt or lm_head:
                raise click.UsageError("give either --format (and --lm-head) or --recipe, not both; a recipe "
                                       "names the head in its own rules")
        elif fmt:
            recipe = Recipe.from_format(fmt, method, lm_head=lm_head)
        else:
            raise click.UsageError("give --format SPEC (e.g. int4-g64) or --recipe FILE")
        if misfit:
            recipe = recipe.with_misfit(misfit)
        if target == "compressed-tensors":
            from fewbits.export import check_formats

            check_formats(cands or [r.format for r in recipe.rules])  # before any work
        elif target == "gguf":
            from fewbits.export.gguf import gguf_type
            from fewbits.formats.format import parse_format

            for f in (cands or [r.format for r in recipe.rules]) + ([embedding] if embedding else []):
                gguf_type(parse_format(f))  # before any work
        elif embedding:
            raise click.UsageError("--embedding is for --to gguf (the fewbits layout keeps the embedding's rows)")
        calib_paths = None
        if calib_files:
            if not budget and not any(METHODS[r.method].needs_data for r in recipe.rules if r.method in METHODS):
                raise click.UsageError(f"--calib is for the calibrated methods "
                                       f"({', '.join(n for n, e in METHODS.items() if e.needs_data)}) and --budget; "
                                       f"{', '.join(sorted({r.method for r in recipe.rules}))} uses no data")
            from fewbits.data.calibration import check_calibration_files

            calib_paths = check_calibration_files(calib_files)  # missing, empty or binary: before any work
        from fewbits.cli.quantize_stream import quantize_streamed_cmd, stream_wanted

        if stream_wanted(model, dtype, stream, target, budget):
            report, path = quantize_streamed_cmd(model, recipe, out, dtype, calib_paths, calib_windows, calib_seq_len,
                                                 overwrite, quiet)
            if distributed.rank() != 0:  # under torchrun rank 0 wrote OUT
                return
            click.echo(report.text())
            disk = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
            click.echo(f"saved to {path} ({disk:,} bytes on disk) in {time.perf_counter() - t0:.1f} s")
            return
        m, tok = load_model(model, dtype=dtype)
        if target == "gguf":
            from fewbits.export.gguf import gguf_arch

            gguf_arch(m)  # before any work
        api.plan_model(m, recipe)  # fails here, before any work, on misfits and unknown methods
        methods = {r.method for r in recipe.rules}
        data = None
        if budget or any(api.METHODS[x].needs_data for x in methods if x in api.METHODS):
            data = api.calibration_data(tok, files=calib_paths, samples=calib_windows, seq_len=calib_seq_len)
        if budget:
            from fewbits.budgeted import budget_recipe

            mix = budget_recipe(m, data.ids, bud, cands, method, device=device, progress=not quiet)
            recipe = mix.recipe
            click.echo(mix.text())
        # only saved: no fast kernels to pack (the reference path is built for free); loading prepares them
        report = api.quantize(m, recipe, data=data, progress=not quiet, chooser=api.kernel_chooser("reference"))
        if distributed.rank() != 0:  # under torchrun every rank holds the same weights; rank 0 saves them
            return
        click.echo(report.text())
        # a budgeted mix's recipe and choice travel inside OUT's atomic write (and its manifest)
        extra = None if mix is None else {"recipe.toml": recipe.to_toml(),
                                          "budget.json": json.dumps(mix.to_dict(), indent=1)}
        if target == "compressed-tensors":
            from fewbits.export import export_compressed_tensors

            path = export_compressed_tensors(m, out, tokenizer=tok, overwrite=overwrite, extra=extra)
        elif target == "gguf":
            from fewbits.export.gguf import export_gguf
            from fewbits.export.gguf_vocab import is_byte_level_bpe
            from fewbits.models.packaged import gguf_tokenizer_pre, source_gguf

            pre = gguf_tokenizer_pre(model)
            with source_gguf(model) as src:  # a SentencePiece vocabulary is copied from the published file
                vocab = None if is_byte_level_bpe(tok) else src
                def write(tmp: Path) -> None:
                    export_gguf(m, tmp / "model.gguf", tok, pre=pre, vocab_from=vocab, embedding=embedding)

                path = write_dir(Path(out), write, overwrite, kind="gguf", extra=extra)
        else:
            path = api.save_quantized_model(m, recipe, out, tokenizer=tok, report=report, source=model,
                                            overwrite=overwrite, extra=extra)
    except click.UsageError:
        raise
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        raise click.ClickException(str(e)) from None
    disk = sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())
    click.echo(f"saved to {path} ({disk:,} bytes on disk) in {time.perf_counter() - t0:.1f} s")
