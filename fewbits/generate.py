"""Decode loop over a (quantised) causal LM with a preallocated, quantised KV cache.

    res = generate(model, input_ids, max_new_tokens=32, kv="int4")              # greedy
    res = generate(model, ids, 32, do_sample=True, temperature=0.8, top_p=0.9, seed=0)
    res.tokens (B, n), res.decode_step_s (per step), res.tokens_per_s, res.kv_nbytes

Works with Hugging Face Llama/Gemma/Qwen-style models (any model whose forward takes a transformers
`Cache`): the cache is a `QuantizedKVCache` sized for prompt + new tokens, allocated once.  A batch of
prompts of different lengths is passed left-padded with an attention mask (1 = real token); positions
are counted from each sequence's first real token.

Step times are wall-clock times of the work itself: on a GPU each timed step ends with a device
synchronisation (`synchronizer`), since a forward pass there only queues kernels.  On a GPU the attention
runs on PyTorch's flash / memory-efficient kernels, never cuDNN's (`attention_backends`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from fewbits.kernels import rows
from fewbits.kernels.wide16 import widened
from fewbits.kvcache.format import KVFormat
from fewbits.kvcache.hf import QuantizedKVCache, cache_for, cache_kwargs


@dataclass
class GenerationResult:
    tokens: torch.Tensor  # (B, n_new) generated ids (eos-padded after a sequence finishes)
    prompt_len: int
    prefill_s: float
    decode_step_s: list[float] = field(default_factory=list)  # wall time of each decode step
    kv_nbytes: int = 0  # exact bytes of the cache after the last step
    kv_format: str = "bf16"
    path: str = "eager"  # "compiled" (fewbits.decode's static graph) or "eager" (the model's own forward)
    compile_s: float = 0.0  # compiling (or loading from the disk cache) the step, apart from the step times
    eager_reason: str = ""  # why a compiled decode ran eagerly instead

    @property
    def batch(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def mean_step_s(self) -> float:
        steps = self.decode_step_s
        return sum(steps) / len(steps) if steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: batch tokens per mean step time."""
        return self.batch / self.mean_step_s if self.decode_step_s else float("nan")


def _no_sync() -> None:
    return None


def synchronizer(device: torch.device | str) -> Callable[[], None]:
    """A callable that waits until the work queued on `device` is done: `torch.cuda.synchronize` for a
    CUDA device, nothing for the CPU (whose operations return when they are done)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return _no_sync


def attention_backends(device: torch.device | str, decode: bool = False) -> contextlib.AbstractContextManager:
    """The scaled-dot-product-attention kernels a decode on `device` may use: on a CUDA device flash,
    memory-efficient and math, not cuDNN.  cuDNN's attention builds an execution plan for every new shape
    (and strides), and a decode step's key length is new at every step: on an H200 a profiled SmolLM2
    step spent its host time in `_cudnn_attention_forward`, and `fewbits bench` measured the same
    16-bit step at ~60 ms where repeating a prompt length (the plans cached) gave 21 ms.

    On a CPU a decode step (`decode`: one query token) runs the math kernel: fp32 scores, softmax and
    value sum, rounded to 16 bits once, which is what the compiled step (`fewbits.decode`) computes.  The
    CPU flash kernel rounds its unnormalised probabilities to 16 bits before the value product and takes a
    20-bit approximation of exp; its outputs differed from fp32 attention in ~35% of a bf16 SmolLM2 layer's
    elements, enough to turn greedy tokens at near ties.  A prefill keeps torch's own choice."""
    if torch.device(device).type != "cuda":
        return sdpa_kernel([SDPBackend.MATH]) if decode else contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def check_device(device: str | torch.device) -> torch.device:
    """`device` as a torch.device, with a clear error when it cannot be used here (an unknown name, or a
    CUDA device on a machine that has none or fewer)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r} ({exc}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: this machine has no CUDA device (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) here")
    elif dev.type != "cpu":
        raise ValueError(f"device {device!r}: fewbits measures on cpu or cuda only")
    return dev


def sample_next(logits: torch.Tensor, do_sample: bool = False, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B,) from last-position logits (B, V): argmax, or sampling with temperature,
    top-k and nucleus (top-p, Holtzman et al. 2020) filtering."""
    if not do_sample:
        return rows.argmax(logits)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    z = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(z, min(top_k, z.shape[-1]), dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:
        sorted_z, idx = torch.sort(z, descending=True, dim=-1)
        probs = torch.softmax(sorted_z, -1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest prefix with mass >= top_p
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        z = torch.full_like(z, float("-inf")).scatter(-1, idx, sorted_z)
    probs = torch.softmax(z, -1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def decode_loop(prefill: Callable[[], torch.Tensor], step: Callable[[torch.Tensor], torch.Tensor],
                max_new_tokens: int, sync: Callable[[], None], do_sample: bool = False, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, eos_token_id: int | None = None,
                generator: torch.Generator | None = None, between: Callable[[], None] | None = None
                ) -> tuple[torch.Tensor, float, list[float]]:
    """The prefill-then-step loop every decode path shares: `prefill()` gives the prompt's last logits (B, V),
    `step(ids)` appends one token per sequence and gives its logits.  Returns the tokens (B, n) (a finished
    sequence padded with `eos_token_id`), the prefill's wall time and every step's, each ended by `sync`.
    `between()`, where given, runs before each step outside its time (`fewbits probe` evicts its skeleton's
    KV cache from the CPU's caches there, `fewbits.bench.evict`)."""
    sync()
    t0 = time.perf_counter()
    nxt = sample_next(prefill(), do_sample, temperature, top_k, top_p, generator)
    sync()
    prefill_s = time.perf_counter() - t0
    tokens = [nxt]
    done = nxt == eos_token_id if eos_token_id is not None else None
    steps: list[float] = []
    for _ in range(max_new_tokens - 1):
        if done is not None and bool(done.all()):
            break
        if between is not None:
            between()
            sync()
        t1 = time.perf_counter()
        nxt = sample_next(step(nxt), do_sample, temperature, top_k, top_p, generator)
        if done is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        sync()
        steps.append(time.perf_counter() - t1)
        tokens.append(nxt)
    return torch.stack(tokens, 1), prefill_s, steps


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    kv: KVFormat | str = "bf16",
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | None = None,
    seed: int | None = None,
    cache: QuantizedKVCache | None = None,
    between: Callable[[], None] | None = None,
) -> GenerationResult:
    """Generate `max_new_tokens` tokens for each row of `input_ids` (B, T) with a KV cache in format `kv`.
    `between`: run before each step, outside its time (`decode_loop`)."""
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be (batch, tokens) with at least one token, got {tuple(input_ids.shape)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    B, T = input_ids.shape
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else input_ids.device
    ids = input_ids.to(device)
    mask = (attention_mask if attention_mask is not None else torch.ones_like(ids)).to(device).long()
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(ids.shape)}")
    cache = cache if cache is not None else cache_for(model, kv, T + max_new_tokens)
    kw = cache_kwargs(model, cache)
    gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    pos = (mask.cumsum(-1) - 1).clamp_min(0)  # (B, T) positions from each first real token
    state = {"mask": mask, "pos": pos[:, -1:]}

    def prefill() -> torch.Tensor:
        with widened():
            return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1,
                         **kw).logits[:, -1]

    def step(nxt: torch.Tensor) -> torch.Tensor:
        state["mask"] = torch.cat([state["mask"], torch.ones(B, 1, dtype=mask.dtype, device=device)], 1)
        state["pos"] = state["pos"] + 1
        with attention_backends(device, decode=True):  # a step's attention as the compiled step computes it
            return model(input_ids=nxt.unsqueeze(-1), attention_mask=state["mask"], position_ids=state["pos"],
                         use_cache=True, logits_to_keep=1, **kw).logits[:, -1]

    with attention_backends(device):  # the whole decode: prefill and steps
        tokens, prefill_s, steps = decode_loop(prefill, step, max_new_tokens, synchronizer(device), do_sample,
                                               temperature, top_k, top_p, eos_token_id, gen, between)
    fmt = cache.fmt.spec if hasattr(cache, "fmt") else str(kv)
    nbytes = cache.nbytes if hasattr(cache, "nbytes") else 0
    return GenerationResult(tokens, T, prefill_s, steps, nbytes, fmt)
