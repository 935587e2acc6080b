"""`fewbits generate MODEL [PROMPT]`: decode text with a (quantised) model on the compiled static-cache path."""

from __future__ import annotations

import click

DEFAULT_PROMPT = "The history of the printing press"


@click.command("generate")
@click.argument("model")
@click.argument("prompt_text", metavar="[PROMPT]", required=False)
@click.option("--prompt", default=None, help=f"the prompt (or as the second argument)  [default: {DEFAULT_PROMPT}]")
@click.option("-n", "--new-tokens", "new_tokens", type=click.IntRange(1, 1 << 16), default=64, show_default=True)
@click.option("--weights", default="bf16", show_default=True, help="weight format (RTN, as `fewbits bench` loads it)")
@click.option("--lm-head", "lm_head", default=None, help="also quantise the LM head to this format")
@click.option("--kv", default="bf16", show_default=True, help="KV-cache format")
@click.option("--threads", type=click.IntRange(0, 1024), default=0, help="torch threads (0: torch's choice)")
@click.option("--device", default="cpu", show_default=True)
@click.option("--activations", type=click.Choice(["16", "q8"]), default="16", show_default=True,
              help="q8: kernels that can round the activations to int8 per block of 32 columns do (llama.cpp's "
                   "Q8_0; CPU with AVX512-VNNI or AVX2), 16: weight-only kernels")
@click.option("--eager", is_flag=True, help="the model's own eager forward instead of the compiled step")
@click.option("--ignore-eos", "ignore_eos", is_flag=True,
              help="decode all --new-tokens tokens, past the end-of-text token (speed runs at a set length)")
def generate_cmd(model: str, prompt_text: str | None, prompt: str | None, new_tokens: int, weights: str,
                 lm_head: str | None, kv: str, threads: int, device: str, activations: str, eager: bool,
                 ignore_eos: bool) -> None:
    """Greedy decode of PROMPT; prints the text, then compile time (apart), prefill time and decode tokens/s."""
    if prompt_text is not None and prompt is not None:
        raise click.UsageError("give the prompt once: as the second argument or with --prompt, not both")
    prompt = prompt_text if prompt_text is not None else (prompt if prompt is not None else DEFAULT_PROMPT)
    import torch

    from fewbits.bench.decode import load_quantized
    from fewbits.decode.generate import generate_static
    from fewbits.formats.format import parse_format
    from fewbits.generate import check_device, generate
    from fewbits.kvcache.format import parse_kv_format
    from fewbits.models.loading import load_tokenizer

    for spec in (weights,) + ((lm_head,) if lm_head else ()):
        try:
            parse_format(spec)
        except ValueError as exc:
            raise click.BadParameter(str(exc)) from None
    try:
        parse_kv_format(kv)
        dev = str(check_device(device))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None
    if threads:
        torch.set_num_threads(threads)
    tok = load_tokenizer(model)
    m, kernels = load_quantized(model, weights, device=dev, lm_head=lm_head, activations=activations)
    ids = tok(prompt, return_tensors="pt").input_ids
    run = generate if eager else generate_static
    res = run(m, ids, new_tokens, kv=kv, eos_token_id=None if ignore_eos else tok.eos_token_id)
    click.echo(prompt + tok.decode(res.tokens[0], skip_special_tokens=True))
    how = res.path + (f" ({res.eager_reason})" if res.eager_reason else "")
    click.echo(f"[{how}; weights {weights} ({kernels}), kv {res.kv_format}; compile {res.compile_s:.1f} s, "
               f"prefill {res.prefill_s * 1e3:.0f} ms, decode {res.mean_step_s * 1e3:.1f} ms/step = "
               f"{res.tokens_per_s:.1f} tok/s over {len(res.decode_step_s)} steps; threads {torch.get_num_threads()}]")
