"""The decode loop: equals transformers' own greedy generate, handles left padding, samples reproducibly."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fewbits.generate as gen_mod
from fewbits.generate import attention_backends, check_device, generate, sample_next, synchronizer
from fewbits.kvcache import parse_kv_format


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


def test_greedy_equals_transformers(tiny):
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(1))
    ref = tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                        pad_token_id=0)[:, 20:]
    res = generate(tiny, ids, 12, kv="fp32")
    assert torch.equal(res.tokens, ref)
    assert len(res.decode_step_s) == 11 and res.tokens_per_s > 0
    assert res.kv_nbytes == parse_kv_format("fp32").nbytes(31, 2, 2, 32, 3)


def test_left_padding_matches_unpadded(tiny):
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    ids[1, :6] = 0
    mask[1, :6] = 0
    batched = generate(tiny, ids, 8, kv="fp32", attention_mask=mask)
    solo = generate(tiny, ids[1:, 6:], 8, kv="fp32")
    assert torch.equal(batched.tokens[1:], solo.tokens)


def test_quantised_cache_generates_and_reports_bytes(tiny):
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(3))
    ref = generate(tiny, ids, 10, kv="bf16")
    for kv in ("int8", "int4-r0"):
        res = generate(tiny, ids, 10, kv=kv)
        assert res.tokens.shape == (2, 10) and res.kv_format == kv
        assert res.kv_nbytes < ref.kv_nbytes


def test_sampling_is_seeded_and_filters():
    logits = torch.tensor([[0.0, 5.0, 4.9, -3.0]])
    assert sample_next(logits).item() == 1
    picks = {sample_next(logits, True, top_k=2, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert picks == {1, 2}
    picks = {sample_next(logits, True, top_p=0.3, generator=torch.Generator().manual_seed(s)).item() for s in range(50)}
    assert picks == {1}
    with pytest.raises(ValueError, match="temperature"):
        sample_next(logits, True, temperature=0)


def test_sampled_generation_reproducible_and_eos(tiny):
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    a = generate(tiny, ids, 6, do_sample=True, temperature=0.9, top_p=0.95, seed=7)
    b = generate(tiny, ids, 6, do_sample=True, temperature=0.9, top_p=0.95, seed=7)
    assert torch.equal(a.tokens, b.tokens)
    first = generate(tiny, ids, 3).tokens[:, 0]
    res = generate(tiny, ids, 6, eos_token_id=int(first[0]))
    assert bool((res.tokens[0] == first[0]).all())  # finished at once, then padded with eos


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="batch, tokens"):
        generate(tiny, torch.zeros(5, dtype=torch.long), 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(tiny, torch.zeros(1, 3, dtype=torch.long), 0)


def test_gemma3_sliding_window_layers_match_transformers():
    """Gemma-3 mixes sliding-window and global layers; the full quantised-cache layout must mask alike."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=16, sliding_window=8,
                           max_position_embeddings=512,
                           layer_types=["sliding_attention"] * 3 + ["full_attention"])
    model = Gemma3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(5))
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                         pad_token_id=0)[:, 30:]
    assert torch.equal(generate(model, ids, 10, kv="fp32").tokens, ref)


def test_every_timed_step_waits_for_the_device(tiny, monkeypatch):
    """On a GPU a forward pass only queues kernels: each timed step (and the prefill) must end with the
    device's synchronisation inside the timed window.  A sync that takes 20 ms shows in every step."""
    calls = []

    def slow_sync(device):
        def sync():
            calls.append(str(device))
            time.sleep(0.02)
        return sync

    monkeypatch.setattr(gen_mod, "synchronizer", slow_sync)
    res = generate(tiny, torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(5)), 4)
    assert len(res.decode_step_s) == 3 and min(res.decode_step_s) >= 0.02 and res.prefill_s >= 0.02
    assert calls == ["cpu"] * (2 + 3)  # before and after the prefill, after every decode step


def test_between_runs_before_every_step_outside_its_time(monkeypatch):
    """`between` (the probe's read of other bytes) runs once before each step, after a sync, and none of its
    time counts: on a clock that it moves by 1000 s and a step by 1 s, every step takes 1 s."""
    now = [0.0]
    events: list[str] = []
    monkeypatch.setattr(gen_mod.time, "perf_counter", lambda: now[0])

    def step(ids: torch.Tensor) -> torch.Tensor:
        events.append("step")
        now[0] += 1.0
        return torch.zeros(1, 4)

    def between() -> None:
        events.append("between")
        now[0] += 1000.0

    tokens, _, steps = gen_mod.decode_loop(lambda: torch.zeros(1, 4), step, 4, lambda: events.append("sync"),
                                           between=between)
    assert steps == [1.0, 1.0, 1.0] and tokens.shape == (1, 4)
    assert events == ["sync", "sync"] + ["between", "sync", "step", "sync"] * 3


def test_synchronizer_per_device(monkeypatch):
    assert synchronizer("cpu")() is None
    seen = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: seen.append(device))
    synchronizer("cuda:1")()
    assert seen == [torch.device("cuda:1")]


def test_check_device_names_what_is_wrong():
    assert check_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        check_device("tpu")
    with pytest.raises(ValueError, match="cpu or cuda only"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            check_device("cuda")
    else:
        with pytest.raises(ValueError, match="CUDA device"):
            check_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kv", ["fp32", "int8", "int4"])
def test_cuda_generates_the_cpu_tokens(tiny, kv):
    """The decode loop and the quantised cache are device-independent: same greedy tokens on the GPU."""
    import copy

    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(6))
    cpu = generate(tiny, ids, 8, kv=kv)
    gpu = generate(copy.deepcopy(tiny).cuda(), ids, 8, kv=kv)
    assert torch.equal(gpu.tokens.cpu(), cpu.tokens) and gpu.kv_nbytes == cpu.kv_nbytes


def test_attention_on_a_gpu_never_takes_cudnn():
    # cuDNN's attention plans every new key length again: a decode step's is new at every step
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends("cuda"):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()
    with attention_backends("cpu"):  # the CPU keeps torch's own choice
        assert torch.backends.cuda.cudnn_sdp_enabled()
