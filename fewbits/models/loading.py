"""Load a model and its tokenizer: a packaged name, a local Hugging Face directory, or a hub id.

    model, tokenizer = load_model("smollm2-135m")            # packaged, converted once and cached
    model, tokenizer = load_model("/path/to/hf_dir", dtype="bf16")
    model, tokenizer = load_model("HuggingFaceTB/SmolLM2-135M")  # the local hub cache only
    model, tokenizer = load_model("HuggingFaceTB/SmolLM2-135M", offline=False)  # may download

Weights are read from safetensors only.  A directory holding only pickle checkpoints (``*.bin``, ``*.pt``,
``*.pth``, ``*.ckpt``) is refused: unpickling a model file can run arbitrary code, and nothing here ever
calls ``torch.load``.  No Python shipped in a model folder is ever run either: every transformers loader
is called with ``trust_remote_code=False``, and a folder whose config.json or tokenizer_config.json holds an
``auto_map`` (transformers' hook for a folder's own classes) is refused before transformers reads it, so no
prompt ever asks whether to run it.  Every safetensors file is checked (header readable, every shard the index names
present and complete) before transformers touches it, so a missing or truncated file is an error that
names the file.

Caveat (see `fewbits.models.packaged`): the packaged causal models were published already quantised
(SmolLM2's linears are GGUF Q4_1, i.e. a 4-bit affine grid per group of 32 weights; Gemma-3-270M's are
mostly Q5_0), so group-32 4-bit results on them are flattering.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fewbits.models.packaged import ensure_converted, packaged_entry

#: architecture name pattern (config.json "architectures") -> transformers Auto class
AUTO_CLASSES: tuple[tuple[str, str], ...] = (
    (r"ForCausalLM$|LMHeadModel$", "AutoModelForCausalLM"),
    (r"ForConditionalGeneration$", "AutoModelForImageTextToText"),
    (r".*", "AutoModel"),
)
#: pickle-based checkpoint file suffixes that are refused
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
#: accepted dtype spellings
DTYPES: dict[str, str] = {"fp32": "float32", "float32": "float32", "float": "float32",
                          "bf16": "bfloat16", "bfloat16": "bfloat16",
                          "fp16": "float16", "float16": "float16", "half": "float16"}


#: files of a model folder that can name Python classes for transformers to import (an "auto_map")
REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json", "processor_config.json",
                     "preprocessor_config.json", "feature_extractor_config.json")
#: environment variable that lets `load_model` ask the model hub for an id not in the local hub cache
HUB_ENV = "FEWBITS_HUB"


class ModelLoadError(ValueError):
    """A model cannot be found or loaded; the message names the model or file at fault."""


def refuse_remote_code(path: str | Path) -> None:
    """Raise ModelLoadError when a folder asks transformers to import its own Python (an ``auto_map`` in
    config.json or tokenizer_config.json): fewbits never runs code from a model folder, and refusing
    before transformers reads the folder means no "trust remote code?" prompt can appear."""
    for name in REMOTE_CODE_FILES:
        f = Path(path) / name
        if not f.is_file():
            continue
        try:
            cfg = json.loads(f.read_bytes())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{f} cannot be read as JSON: {str(exc).splitlines()[0]}") from None
        subs = [cfg] + [v for v in cfg.values() if isinstance(v, dict)] if isinstance(cfg, dict) else []
        if any("auto_map" in d for d in subs):
            raise ModelLoadError(f"{f} has an auto_map: the folder asks to run its own Python code, which fewbits "
                                 "never runs (trust_remote_code=False); use a model whose architecture "
                                 "transformers ships")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: kind in {"packaged", "local", "hub"}; `path` for the first two."""

    kind: str
    name: str
    path: Path | None = None


def resolve_model(name_or_path: str | Path) -> ModelSource:
    """Decide whether `name_or_path` is a packaged model, a local directory, or a hub id."""
    text = str(name_or_path)
    entry = packaged_entry(text)
    if entry is not None and not Path(text).exists():
        return ModelSource("packaged", entry.name)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelLoadError(f"model path {path} is a file; pass the model directory (with config.json)")
        return ModelSource("local", text, path)
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or "\\" in text:
        raise ModelLoadError(f"model directory {path} does not exist")
    return ModelSource("hub", text)


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """Parse and check a safetensors header: 8-byte length, JSON, every tensor inside the file."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ModelLoadError(f"weight file {path} is corrupt: {size} bytes, too short for safetensors")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100_000_000:
                raise ModelLoadError(f"weight file {path} is corrupt: header length {n} exceeds file size {size}")
            header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"weight file {path} is corrupt: unreadable safetensors header ({exc})") from None
    except OSError as exc:
        raise ModelLoadError(f"weight file {path} cannot be read: {exc}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"weight file {path} is corrupt: its header is a {type(header).__name__}, not an object")
    for k, v in header.items():
        if k == "__metadata__":
            continue
        offs = v.get("data_offsets") if isinstance(v, dict) else None
        shape = v.get("shape") if isinstance(v, dict) else None
        if not (isinstance(offs, list) and len(offs) == 2 and all(type(o) is int and o >= 0 for o in offs)
                and offs[0] <= offs[1] and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(v.get("dtype"), str)):
            raise ModelLoadError(f"weight file {path} is corrupt: tensor {str(k)[:80]!r} is described wrongly")
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ModelLoadError(f"weight file {path} is corrupt or truncated: header describes "
                             f"{8 + n + end} bytes, file has {size}")
    return header


def check_model_dir(path: Path) -> list[Path]:
    """The safetensors files of a local model directory, each checked; clear errors otherwise."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"model directory {path} has no config.json")
    index = sorted(path.glob("*.safetensors.index.json"))
    if index:
        try:
            weight_map = json.loads(index[0].read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"weight index {index[0]} is corrupt: {exc}") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelLoadError(f"model directory {path} holds only pickle checkpoints ({', '.join(pickles)}); "
                                 "fewbits loads safetensors only, never pickles (convert with "
                                 "safetensors' convert tool where you trust the file)")
        raise ModelLoadError(f"model directory {path} has no weight file (expected model.safetensors)")
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"weight file {f} is missing (listed in {index[0].name})" if index
                                 else f"weight file {f} is missing")
        read_safetensors_header(f)
    return files


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = str(dtype).lower().removeprefix("torch.")
    if key not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of {', '.join(sorted(DTYPES))}")
    return getattr(torch, DTYPES[key])


def _auto_class(architectures: list[str] | None) -> Any:
    import transformers

    arch = (architectures or [""])[0]
    for pattern, cls in AUTO_CLASSES:
        if re.search(pattern, arch):
            return getattr(transformers, cls)
    raise AssertionError("the last AUTO_CLASSES pattern matches everything")


def load_model(name_or_path: str | Path, dtype: Any = "float32", device: str = "cpu",
               offline: bool | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) in eval mode for a packaged name, a local directory, or a hub id.

    dtype: torch dtype or one of fp32/bf16/fp16 (default float32, the fastest on CPU and lossless for
    the packaged models); device: where to put the model; offline: for hub ids, use the local hub
    cache only (fail at once instead of retrying an unreachable network); None (the default) means
    offline unless the environment sets FEWBITS_HUB=1."""
    torch_dtype = _torch_dtype(dtype)
    source = resolve_model(name_or_path)
    if source.kind == "packaged":
        path = ensure_converted(source.name)
        return _load_dir(path, torch_dtype, device, label=f"packaged model {source.name!r} ({path})")
    if source.kind == "local":
        assert source.path is not None
        check_model_dir(source.path)
        return _load_dir(source.path, torch_dtype, device, label=f"model directory {source.path}")
    if offline is None:
        offline = os.environ.get(HUB_ENV, "") not in ("1", "true", "yes")
    return _load_hub(source.name, torch_dtype, device, offline)


def load_tokenizer(name_or_path: str | Path, offline: bool | None = None) -> Any:
    """The tokenizer of a packaged name, a local directory, or a hub id, without loading the model's weights
    (`load_model` reads those too: ~4 s for the packaged models here).  offline: as for `load_model`."""
    from transformers import AutoTokenizer

    source = resolve_model(name_or_path)
    if source.kind == "hub":
        if offline is None:
            offline = os.environ.get(HUB_ENV, "") not in ("1", "true", "yes")
        try:
            return AutoTokenizer.from_pretrained(source.name, local_files_only=offline, trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise _hub_error(source.name, offline, exc) from None
    path = ensure_converted(source.name) if source.kind == "packaged" else source.path
    assert path is not None
    refuse_remote_code(path)
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"model {source.name!r} ({path}): tokenizer cannot be loaded: {exc}") from None


def random_model(name_or_config: str | Path, dtype: Any = "bf16", device: str = "cpu", seed: int = 0) -> Any:
    """A causal LM with the architecture of a built-in model (`fewbits models`) or of a config.json (a file
    or a folder holding one), with random weights (transformers' own initialisation), built directly on
    `device`, in eval mode.

    For speed measurements where the weights cannot be had (a machine with no hub access): the time of a
    decode step does not depend on the values, only on the shapes, formats and kernels.  The global random
    state is left as it was (`seed` seeds a forked generator)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fewbits.models.presets import preset_config

    p = Path(name_or_config)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            cfg = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"{p}: config.json cannot be read: {exc}") from None
    else:
        cfg = preset_config(str(name_or_config))[1]
    if "model_type" not in cfg:
        raise ModelLoadError(f"{name_or_config}: the config has no 'model_type', so its architecture is unknown")
    config = AutoConfig.for_model(**cfg)
    dev = torch.device(device)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(seed)
        with dev:
            model = AutoModelForCausalLM.from_config(config, dtype=_torch_dtype(dtype))
    return model.eval()


def _load_dir(path: Path, dtype: Any, device: str, label: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    refuse_remote_code(path)
    try:
        config = AutoConfig.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{label}: config.json cannot be read: {exc}") from None
    cls = _auto_class(getattr(config, "architectures", None))
    try:
        model = cls.from_pretrained(str(path), dtype=dtype, use_safetensors=True, local_files_only=True,
                                    trust_remote_code=False)
    except (OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{label}: weights cannot be loaded: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{label}: tokenizer cannot be loaded: {exc}") from None
    return model.to(device).eval(), tokenizer


def _load_hub(repo_id: str, dtype: Any, device: str, offline: bool) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(repo_id, local_files_only=offline, trust_remote_code=False)
        cls = _auto_class(getattr(config, "architectures", None))
        model = cls.from_pretrained(repo_id, dtype=dtype, use_safetensors=True, local_files_only=offline,
                                    trust_remote_code=False)
        tokenizer = AutoTokenizer.from_pretrained(repo_id, local_files_only=offline, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise _hub_error(repo_id, offline, exc) from None
    return model.to(device).eval(), tokenizer


def _hub_error(repo_id: str, offline: bool, exc: Exception) -> ModelLoadError:
    """What a hub id that could not be loaded is told: the packaged names (the closest first), and why."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    close = difflib.get_close_matches(repo_id.lower(), _packaged_names(), n=2, cutoff=0.6)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    where = (f"as a hub id it is not in the local hub cache (set {HUB_ENV}=1 to let fewbits download it)"
             if offline
             else f"the model hub could not provide it: {first}")
    return ModelLoadError(f"{repo_id!r} is not a packaged model ({', '.join(_packaged_names())}) nor a "
                          f"local directory; {hint}{where}")


def _packaged_names() -> list[str]:
    from fewbits.models.packaged import PACKAGED

    return list(PACKAGED)


def model_bytes(model: Any) -> int:
    """Bytes of a module's parameters and buffers, each shared tensor counted once, and the packed codes that
    QuantLinear kernels hold in their stead."""
    seen: set[int] = set()
    total = sum(getattr(m, "held_codes_nbytes", 0) for m in model.modules())
    for t in list(model.parameters()) + list(model.buffers()):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.numel() * t.element_size()
    return total


__all__ = ["load_model", "load_tokenizer", "resolve_model", "check_model_dir", "read_safetensors_header", "model_bytes",
           "ModelLoadError", "ModelSource", "refuse_remote_code", "AUTO_CLASSES", "PICKLE_SUFFIXES"]
