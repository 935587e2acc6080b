"""Fuzzing the files fewbits reads (issue 20): fewbits.json, recipe files, safetensors headers, GGUF headers.
Every input loads or gets a one-line error of a fewbits error type (what the CLI prints without a
traceback); no hang (a deadline per input); memory bounded by the input, not by a size field (tracemalloc
peak per input).  Hypothesis runs derandomised with bounded examples (CI: well under a minute).

    FEWBITS_FUZZ_EXAMPLES=300 python -m pytest -s tests/test_fuzz_inputs.py   # a campaign; prints the tally
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tracemalloc
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("FEWBITS_FUZZ_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, derandomize=True, deadline=5000, database=None,
                    suppress_health_check=list(HealthCheck))
#: what the fuzz run saw: inputs tried, handled cleanly (loaded or a fewbits error), defects
TALLY: Counter[str] = Counter()

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=12), kids, max_size=4),
    max_leaves=12)


@pytest.fixture(scope="module", autouse=True)
def tally():
    """Print inputs tried / handled cleanly / defects per target at the end (shown with -s)."""
    yield TALLY
    for t in sorted({k.rsplit(" ", 1)[0] for k in TALLY}):
        print(f"\nfuzz {t:12s} tried {TALLY[t + ' tried']:5d}  clean {TALLY[t + ' clean']:5d}  "
              f"defects {TALLY[t + ' defects']}", end="")


def _clean(target: str, fn: Any, *args: Any, size: int = 0) -> None:
    """Call fn; a result or a one-line fewbits error is clean; anything else, a multi-line message or memory
    beyond the input's size (plus a fixed allowance) is a defect."""
    TALLY[f"{target} tried"] += 1
    tracemalloc.start()
    try:
        fn(*args)
    except Exception as e:
        mod = type(e).__module__ or ""
        if not mod.startswith("fewbits") or "\n" in str(e):
            TALLY[f"{target} defects"] += 1
            raise AssertionError(f"{target}: {type(e).__module__}.{type(e).__name__}: {str(e)[:300]}") from e
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    if peak > 64 * 2**20 + 16 * size:
        TALLY[f"{target} defects"] += 1
        raise AssertionError(f"{target}: {peak / 2**20:.0f} MiB for an input of {size} bytes")
    TALLY[f"{target} clean"] += 1


# ---------------------------------------------------------------------- fewbits.json
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from fewbits import api
    from fewbits.models.recipe import Recipe
    from tests.api.conftest import make_tiny_llama

    tiny = make_tiny_llama(hidden=32)
    recipe = Recipe.from_format("int4-g32")
    api.quantize(tiny, recipe, progress=False, chooser="reference")
    return api.save_quantized_model(tiny, recipe, tmp_path_factory.mktemp("saved") / "q")


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _mutated_meta(meta: dict, data: st.DataObject) -> Any:
    paths = [p for p in _paths(meta) if p]
    path = data.draw(st.sampled_from(paths))
    action = data.draw(st.sampled_from(["replace", "delete", "nest"]))
    m = json.loads(json.dumps(meta))
    parent = m
    for k in path[:-1]:
        parent = parent[k]
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    elif action == "nest":
        parent[path[-1]] = json.loads("[" * 500 + "]" * 500)
    else:
        parent[path[-1]] = data.draw(json_values)
    return m


@SETTINGS
@given(data=st.data())
def test_fuzz_saved_metadata(saved, tmp_path_factory, data):
    from fewbits import api

    d = tmp_path_factory.mktemp("m") / "q"
    shutil.copytree(saved, d)
    (d / "fewbits-manifest.json").unlink()  # the fields themselves, not the checksum, are under test
    meta = json.loads((saved / "fewbits.json").read_text())
    if data.draw(st.booleans()):
        text = json.dumps(_mutated_meta(meta, data), allow_nan=True).encode()
    else:
        raw = json.dumps(meta).encode()
        cut = data.draw(st.integers(0, len(raw)))
        text = raw[:cut] + data.draw(st.binary(max_size=16)) + raw[cut + data.draw(st.integers(0, 8)):]
    (d / "fewbits.json").write_bytes(text)
    _clean("fewbits.json", api.load_quantized_model, d, "reference", size=len(text))


# ---------------------------------------------------------------------- recipe files
recipe_dicts = st.fixed_dictionaries({}, optional={
    "version": st.integers(0, 3) | json_values,
    "rules": st.lists(st.fixed_dictionaries({}, optional={
        "pattern": st.sampled_from([".*", "mlp", "(", "[", "lm_head", ""]) | st.text(max_size=8),
        "format": st.sampled_from(["int4-g64", "int8", "nf4-g64", "fp8-e4m3", "int4-g0", "x"]) | json_values,
        "method": st.sampled_from(["rtn", "gptq", "nope"]) | json_values,
        "options": json_values}), max_size=3) | json_values,
    "ignore": st.lists(st.text(max_size=8), max_size=3) | json_values,
    "misfit": st.sampled_from(["error", "keep", "regroup", "x"]) | json_values,
})


@SETTINGS
@given(d=recipe_dicts, suffix=st.sampled_from([".json", ".toml"]), junk=st.binary(max_size=12))
def test_fuzz_recipe_files(tmp_path_factory, d, suffix, junk):
    from fewbits.models.recipe import Recipe

    p = tmp_path_factory.mktemp("r") / f"recipe{suffix}"
    if suffix == ".json":
        text = json.dumps(d).encode()
    else:
        try:
            text = Recipe.from_dict(d).to_toml().encode()
        except Exception:
            text = json.dumps(d).encode()  # not TOML at all: the parser's error
    text = text + junk if junk[:1] == b"\xff" else text
    p.write_bytes(text)
    _clean("recipe", Recipe.load, p, size=len(text))


# ---------------------------------------------------------------------- safetensors headers
@pytest.fixture(scope="module")
def qfile(tmp_path_factory):
    from fewbits.tensor import quantize_tensor, save_quantized

    p = tmp_path_factory.mktemp("t") / "q.safetensors"
    torch.manual_seed(0)
    save_quantized(p, {"w": quantize_tensor(torch.randn(8, 64), "int4-g32"),
                       "v": quantize_tensor(torch.randn(4, 32), "nvfp4")})
    return p


def _header_variant(raw: bytes, data: st.DataObject) -> bytes:
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    kind = data.draw(st.sampled_from(["length", "json", "bytes", "field"]))
    if kind == "length":
        n2 = data.draw(st.sampled_from([0, 1, n - 1, n + 1, 2**31, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
        return struct.pack("<Q", n2) + raw[8:]
    if kind == "bytes":
        pos = data.draw(st.integers(8, 8 + n - 1))
        return raw[:pos] + data.draw(st.binary(min_size=1, max_size=4)) + raw[pos + 1:]
    if kind == "field":
        name = data.draw(st.sampled_from(sorted(header)))
        entry = header[name]
        if isinstance(entry, dict) and name != "__metadata__":
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
            entry[key] = data.draw(st.sampled_from([
                "BF16", "F64", "U8", "I64", "X", [2**40, 2**40], [0, 2**62], [-1, 3], [], [1] * 10]) | json_values)
        else:
            fb = json.loads(header["__metadata__"]["fewbits"])
            path = data.draw(st.sampled_from([p for p in _paths(fb) if p]))
            parent = fb
            for k in path[:-1]:
                parent = parent[k]
            parent[path[-1]] = data.draw(json_values)
            header["__metadata__"]["fewbits"] = json.dumps(fb)
    else:
        header = data.draw(json_values)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + raw[8 + n:]


@SETTINGS
@given(data=st.data())
def test_fuzz_safetensors_headers(qfile, tmp_path_factory, data):
    from fewbits.models.loading import read_safetensors_header
    from fewbits.tensor import load_quantized

    blob = _header_variant(qfile.read_bytes(), data)
    p = tmp_path_factory.mktemp("s") / "q.safetensors"
    p.write_bytes(blob)
    _clean("safetensors", read_safetensors_header, p, size=len(blob))
    _clean("safetensors", load_quantized, p, size=len(blob))


# ---------------------------------------------------------------------- GGUF headers
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    gguf = pytest.importorskip("gguf")
    p = tmp_path_factory.mktemp("g") / "t.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    w.add_tensor("token_embd.weight", torch.randn(3, 8).numpy())
    w.add_tensor("blk.0.attn_q.weight", torch.randn(8, 8).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


@SETTINGS
@given(data=st.data())
def test_fuzz_gguf_headers(gguf_file, tmp_path_factory, data):
    from fewbits.models.packaged import gguf_tensor_types

    raw = bytearray(gguf_file.read_bytes())
    head = min(len(raw), 400)  # magic, version, counts, the key/value pairs and the tensor table
    for _ in range(data.draw(st.integers(1, 4))):
        if data.draw(st.booleans()):  # a 64-bit count or length field replaced
            pos = data.draw(st.integers(0, head - 8))
            raw[pos:pos + 8] = struct.pack("<Q", data.draw(st.sampled_from([0, 2**31, 2**40, 2**63, 2**64 - 1])))
        else:
            pos = data.draw(st.integers(0, head - 1))
            raw[pos] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        raw = raw[:data.draw(st.integers(0, len(raw)))]
    p = tmp_path_factory.mktemp("gg") / "t.gguf"
    p.write_bytes(bytes(raw))
    _clean("gguf", gguf_tensor_types, p, size=len(raw))
