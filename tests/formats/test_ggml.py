"""llama.cpp's block types as fewbits formats, checked against gguf-py: its dequantiser (every type, exact),
its quantisers (the 32-weight types, byte for byte), its block sizes; K-quant grids reproduced exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fewbits.formats import ggml
from fewbits.formats.format import parse_format
from fewbits.formats.ggml_types import GGML_TYPES
from fewbits.methods.common import MethodError, check_method_format
from fewbits.tensor import QuantizedTensor, load_quantized, quantize_tensor, save_quantized

gguf = pytest.importorskip("gguf")
SPECS = list(GGML_TYPES)


def _qtype(spec: str):
    return getattr(gguf.GGMLQuantizationType, GGML_TYPES[spec].gguf_name)


def _weights(rows: int = 6, cols: int = 512, seed: int = 0) -> torch.Tensor:
    """Gaussian rows with the cases block quantisers special-case: an outlier, an all-zero block, a constant
    block, an all-positive block."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[0, 7] = 0.9
    if rows >= 4:
        w[1, :256] = 0
        w[2, 32:64] = 0.25
        w[3, 256:] = w[3, 256:].abs() + 0.01
    return w


@pytest.mark.parametrize("spec", SPECS)
def test_dequantise_equals_gguf_py_on_random_blocks(spec):
    """Any bytes a GGUF file may hold (random codes, random finite fp16 scales and mins) decode to gguf-py's
    values bit for bit."""
    t = GGML_TYPES[spec]
    rows, cols = 5, 512
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (rows, cols // t.block * t.block_bytes), dtype=torch.uint8, generator=g)
    blocks = raw.reshape(-1, t.block_bytes)
    fp16 = (torch.randn(blocks.shape[0], 2, generator=g) * 0.01).to(torch.float16).view(torch.uint8)
    at = {32: [0, 2] if t.has_min else [0], 256: [0, 2] if t.has_min else [t.block_bytes - 2]}[t.block]
    for k, off in enumerate(at):  # finite d (and dmin / min) where the type keeps them
        blocks[:, off:off + 2] = fp16[:, 2 * k:2 * k + 2]
    codes, header = ggml.from_gguf_blocks(raw, parse_format(spec), cols)
    assert torch.equal(ggml.to_gguf_blocks(codes, header, parse_format(spec)), raw)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), _qtype(spec)))
    got = ggml.dequantize(codes, header, parse_format(spec))
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec", SPECS)
def test_round_to_nearest_through_quantize_tensor(spec):
    w = _weights()
    qt = quantize_tensor(w, spec, name="w")
    fmt = parse_format(spec)
    block_bytes = gguf.GGML_QUANT_SIZES[_qtype(spec)][1]
    assert qt.nbytes == fmt.nbytes(tuple(w.shape)) == w.numel() // fmt.group_size * block_bytes
    assert fmt.bits_per_weight() == 8 * block_bytes / fmt.group_size
    raw = ggml.to_gguf_blocks(qt.unpacked_codes(), qt.scales, fmt)
    want = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), _qtype(spec)))
    assert torch.equal(qt.dequantize(), want.reshape(w.shape))
    assert torch.equal(qt.dequantize()[1, :256], torch.zeros(256))  # an all-zero block stays zero
    if fmt.group_size == 256:  # with +0 scales, as llama.cpp's maxima start at +0 (no -0.0 sign bit)
        assert int(qt.scales[1, :GGML_TYPES[spec].header_bytes].sum()) == 0
    rel = (qt.dequantize() - w).norm() / w.norm()
    assert rel < {4: 0.2, 5: 0.1, 6: 0.05, 8: 0.01}[fmt.bits], float(rel)


@pytest.mark.parametrize("spec", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_bytes_equal_gguf_py_quantisers(spec):
    w = _weights(8, 1024, seed=5)
    codes, header = ggml.quantize(w, parse_format(spec))
    got = ggml.to_gguf_blocks(codes, header, parse_format(spec))
    want = torch.from_numpy(gguf.quants.quantize(w.numpy(), _qtype(spec)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("spec", ["q4_k", "q5_k"])
def test_k_quant_grid_values_come_back_exactly(spec):
    """Weights already on a Q4_K / Q5_K grid (sub-block scale 63 * 2^-10, min 63 * 2^-9, every code used):
    the first least-squares candidate fits them with zero error, 63 / max_scale gives 6-bit scales of 63,
    and d = 2^-10, dmin = 2^-9 are exact in fp16, so every value is reproduced bit for bit."""
    nmax = 2 ** GGML_TYPES[spec].bits - 1
    s, m = 63 * 2.0**-10, 63 * 2.0**-9
    g = torch.Generator().manual_seed(1)
    c = torch.stack([torch.randperm(32, generator=g) % (nmax + 1) for _ in range(16)]).reshape(2, 256)
    c[:, ::32] = 0  # every sub-block spans the whole grid
    c[:, 1::32] = nmax
    w = (c.float() * s - m).to(torch.float32)
    qt = quantize_tensor(w, spec)
    assert torch.equal(qt.dequantize(), w)
    header = qt.scales.reshape(-1, 16)
    assert torch.equal(header[:, :2].contiguous().view(torch.float16).float().unique(), torch.tensor([2.0**-10]))


def test_q6_k_sub_scales_are_signed_and_the_extreme_takes_code_zero():
    """Each sub-block's extreme of either sign maps to -32 (code 0): a positive extreme through a negative
    sub-block scale.  The largest sub-scale in magnitude becomes -128 (iscale = -128 / max_scale)."""
    w = _weights(2, 256, seed=2)  # w[0, 7] = 0.9: the positive extreme of sub-block 0 and of the block
    w[0, 16:32] = -w[0, 16:32].abs()
    w[0, 16] = -0.5  # the negative extreme of sub-block 1
    codes, header = ggml.quantize(w, parse_format("q6_k"))
    assert int(codes[0, 7]) == 0 and int(codes[0, 16]) == 0
    sc = header[0, :16].contiguous().view(torch.int8)
    assert int(sc[0]) == -128 and 0 < int(sc[1]) < 127


def test_spec_metadata_and_storage_round_trip(tmp_path):
    for spec in SPECS:
        fmt = parse_format(spec)
        assert fmt.spec == spec and parse_format(fmt.spec) == fmt
        assert type(fmt).from_dict(fmt.to_dict()) == fmt
        assert fmt.regrouped(300) is None  # the block is part of the type
    tensors = {s: quantize_tensor(_weights(3, 256, seed=i), s) for i, s in enumerate(SPECS)}
    save_quantized(tmp_path / "t.safetensors", tensors)
    back = load_quantized(tmp_path / "t.safetensors")
    for s, qt in tensors.items():
        assert torch.equal(back[s].dequantize(), qt.dequantize()), s


def test_misshapen_headers_are_refused_by_name():
    qt = quantize_tensor(_weights(2, 256), "q4_k")
    bad = QuantizedTensor(qt.codes, qt.scales[:, :8], None, None, qt.shape, qt.fmt)
    with pytest.raises(ValueError, match="w: scales"):
        bad._validate("w")
    with pytest.raises(ValueError, match="not divisible"):
        quantize_tensor(torch.randn(4, 96), "q4_k", name="w")


@pytest.mark.parametrize("method", ["awq", "awq+gptq", "hqq"])
def test_calibrated_methods_refuse_block_types(method):
    """GPTQ takes the block types (tests/methods/test_gptq_ggml.py); the others do not, and say so."""
    with pytest.raises(MethodError, match="q4_k"):
        check_method_format(method, "q4_k")
    assert check_method_format("gptq", "q4_k").spec == "q4_k"


def test_float64_input_quantises_as_float32():
    """The quantiser works in float32 whatever the input dtype (llama.cpp quantises float32 rows)."""
    w = _weights(2, 256).double()
    a = ggml.quantize(w, parse_format("q4_k"))
    b = ggml.quantize(w.float(), parse_format("q4_k"))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_q4_1_reproduces_the_published_smollm2_file(smollm2_dir):
    """The packaged SmolLM2 was published as Q4_1 by llama.cpp; fewbits' q4_1 round-to-nearest of its weights
    (converted from that file) writes the published blocks again, byte for byte (all 210 tensors do; five
    layers here).  q and k are compared in llama.cpp's rotary row order."""
    from gguf import GGUFReader
    from safetensors import safe_open

    from fewbits.export.gguf import _permute_rows
    from fewbits.models.packaged import packaged_entry, source_files

    hf = {"ffn_down": "mlp.down_proj", "ffn_up": "mlp.up_proj", "ffn_gate": "mlp.gate_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj"}
    fmt = parse_format("q4_1")
    checked = 0
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        for t in GGUFReader(source_files(packaged_entry("smollm2-135m"))[0]).tensors:
            parts = t.name.split(".")
            if t.tensor_type.name != "Q4_1" or int(parts[1]) >= 5:
                continue
            w = f.get_tensor(f"model.layers.{parts[1]}.{hf[parts[2]]}.weight").float()
            if parts[2] in ("attn_q", "attn_k"):
                w = w[_permute_rows(w.shape[0], 9 if parts[2] == "attn_q" else 3)]
            codes, header = ggml.quantize(w, fmt)
            assert torch.equal(ggml.to_gguf_blocks(codes, header, fmt).reshape(-1),
                               torch.from_numpy(np.array(t.data)).reshape(-1)), t.name
            checked += 1
    assert checked == 35


@pytest.mark.parametrize("spec", ["q4_k", "q5_k", "q6_k"])
def test_codes_under_fixed_headers_are_llama_cpps(spec):
    """A calibrated method fixes each super-block's header, then encodes columns one at a time: on the header
    llama.cpp's reference picks, the column-by-column codes are its codes (where the sub-block scale is not
    0; there any code decodes to the same value) and decode to its values bit for bit."""
    fmt = parse_format(spec)
    w = _weights(8, 1024, seed=7)
    codes, header = ggml.quantize(w, fmt)
    s, m = ggml.column_grid(header, fmt, w.shape[1])
    cols = [ggml.encode(w[:, j:j + 1], s[:, j:j + 1], None if m is None else m[:, j:j + 1], fmt) for j in range(1024)]
    mine = torch.cat(cols, 1)
    live = s != 0
    assert live.float().mean() > 0.9
    assert torch.equal(mine[live], codes[live])
    assert torch.equal(ggml.dequantize(mine, header, fmt), ggml.dequantize(codes, header, fmt))


@pytest.mark.parametrize("spec", ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"])
def test_codes_under_fixed_32_weight_headers_are_the_nearest(spec):
    """The 32-weight types: encoded on the header llama.cpp's reference picks, every weight gets the nearest
    value of the grid the file decodes (fp16 d and min), so no worse than llama.cpp's codes (rounded with the
    unrounded d), and the codes are llama.cpp's but for near-ties and zero blocks."""
    fmt = parse_format(spec)
    w = _weights(8, 1024, seed=7)
    codes, header = ggml.quantize(w, fmt)
    s, m = ggml.column_grid(header, fmt, w.shape[1])
    mine = ggml.encode(w, s, m, fmt)
    err_mine = (ggml.dequantize(mine, header, fmt) - w).abs()
    err_ref = (ggml.dequantize(codes, header, fmt) - w).abs()
    assert (err_mine <= err_ref).all()
    live = s != 0  # where d is 0 any code decodes to the same value
    assert live.float().mean() > 0.7 and (mine == codes)[live].float().mean() > 0.99
    assert torch.equal(ggml.decode(mine, s, m, fmt), ggml.dequantize(mine, header, fmt))
