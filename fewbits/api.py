"""The one orchestrator: quantise a whole model with a recipe, save it, load it again.

    api.quantize(model, "int4-g64", method=GPTQ(act_order=True, damp=0.01),
                 data=api.calibration_data(tokenizer, files=["my_text.txt"], samples=16, seq_len=256))

Methods plug in through `METHODS` (`fewbits.methods.registry`), an explicit table of name ->
`MethodEntry` (runner "module:function", whether it needs calibration data, its typed config class in
`fewbits.methods.config`).  A method runner has the signature

    runner(model, layers, data, commit, progress) -> dict | None

- `layers`: the `LayerPlan`s (action "quantize") this method must handle, in module order, each with
  its typed options (`plan.config`);
- `data`: calibration token ids (n_samples, seq_len) LongTensor, or None;
- `commit(name, q)`: hands over one finished layer: a `QuantizedTensor` (wrapped in a QuantLinear that
  keeps the old bias) or a ready `nn.Module`; the full-precision weight is released at once, so a
  runner that commits each layer as soon as it is done never holds two copies of the weights;
- the returned dict (JSON-able) lands in the report under "method_info".
Every planned layer must be committed exactly once; `quantize` checks that.

Kernels.  How a quantised layer runs its matmul is chosen by a *kernel chooser* (see `KERNELS`).  The
layers are built on the reference path while a method runs (cheap, and exact for any calibration pass
through them); when the model is complete, `quantize` and `load_quantized_model` prepare the chosen
kernels once (`use_kernels`).  The default is the dispatcher ("auto"): the fastest correct path for the
format, shape and device (bf16 activations on the CPU's int4/int8 paths), the reference path with a
logged reason where there is none.  Quality measurements that must see the exact dequantised weights
pass "cached" (dequantise once, exact) or "reference" (dequantise on every call, exact, no dense copy).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fewbits.budgeted import Budget, MixPlan, budget_recipe  # noqa: F401  (mixed precision under a budget)
from fewbits.data.calibration import CalibrationData, calibration_data, describe_ids  # noqa: F401  (names of the api)
from fewbits.files import check_output, write_dir
from fewbits.guard import QuantizeError, check_layers, refuse_if_unusable, stopped_half_way
from fewbits.methods.config import (  # noqa: F401  (names of the api: one typed config per method)
    AWQ,
    AWQGPTQ,
    GPTQ,
    HQQ,
    RTN,
    LLMInt8,
    MethodConfig,
    MethodConfigError,
    SmoothQuant,
)
from fewbits.methods.registry import METHODS, MethodEntry  # noqa: F401  (the method table)
from fewbits.models.moe import has_routed_experts, unfuse_experts
from fewbits.models.qlinear import (
    KernelChooser,
    LayerMetaError,
    QuantLinear,
    describe_layers,
    kernel_name,
    rebuild_layer,
    reference_chooser,
)
from fewbits.models.recipe import LayerPlan, Recipe
from fewbits.models.swap import linear_shapes, model_nbytes, swap_in, tied_parameters
from fewbits.quantize_report import QuantizeReport
from fewbits.saved import (  # noqa: F401  (names of the api)
    META_FILE,
    READABLE_VERSIONS,
    SAVED_FORMAT,
    SAVED_VERSION,
    WEIGHTS_FILE,
    SavedModelError,
    check_finite,
    check_integrity,
    read_saved_meta,
)
from fewbits.tensor import QuantizedTensor, quantize_tensor
from fewbits.tensorfile import owned

log = logging.getLogger("fewbits.api")

Commit = Callable[[str, "QuantizedTensor | nn.Module"], None]
MethodRunner = Callable[[nn.Module, Sequence[LayerPlan], "torch.Tensor | None", Commit, bool], "dict | None"]


def run_rtn(model: nn.Module, layers: Sequence[LayerPlan], data: torch.Tensor | None, commit: Commit,
            progress: bool = True) -> dict[str, Any]:
    """Round-to-nearest, one layer at a time: quantise, commit (frees the weight), next."""
    for plan in tqdm(layers, desc="rtn", unit="layer", disable=not progress, leave=False):
        w = model.get_submodule(plan.name).weight.detach()  # (out, in)
        commit(plan.name, quantize_tensor(w, plan.format, name=plan.name))
    return {}


#: how QuantLinear layers run their matmul: "auto" is the kernel dispatcher (fast paths, activations in
#: bf16 on the CPU's int4/int8 kernels; the default); "cached" dequantises once and keeps the dense weight
#: (exact: the reference numbers, fast evaluation on CPU, a dense copy in memory); "reference" dequantises
#: on every call (exact, slow, no copy); "auto-a8" is the dispatcher letting kernels round the activations to
#: int8 as well (llama.cpp's Q8_0 activation blocks on the CPU's few-row paths: faster decode, another rounding)
KERNELS: dict[str, str] = {
    "reference": "fewbits.models.qlinear:reference_chooser",
    "cached": "fewbits.models.qlinear:dequantized_once_chooser",
    "auto": "fewbits.kernels.dispatch:prepare_linear",
    "auto-a8": "fewbits.kernels.dispatch:prepare_linear_q8",
}
#: the kernels `quantize` and `load_quantized_model` prepare when they are given no chooser
DEFAULT_KERNEL = "auto"


def kernel_chooser(name: str) -> KernelChooser:
    """The chooser called `name` in KERNELS."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel choice {name!r}; one of {', '.join(KERNELS)}")
    module, attr = KERNELS[name].split(":")
    return getattr(importlib.import_module(module), attr)


def use_kernels(model: nn.Module, chooser: KernelChooser | str | None = None) -> dict[str, int]:
    """Prepare the matmul of every QuantLinear in `model` (those inside wrapper layers too) with `chooser`:
    a KernelChooser, a name in KERNELS, or None for DEFAULT_KERNEL ("auto", the dispatcher).

    Returns how many layers run on each kernel, e.g. {"cpu_int4pack": 210}; the dispatcher logs why a
    layer falls back to the reference path.  Later moves (`model.to(device)`) prepare the same chooser again.
    """
    choose = chooser if callable(chooser) else kernel_chooser(chooser or DEFAULT_KERNEL)
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.set_kernel(choose)
    counts = kernels_in_use(model)
    if counts:
        log.info("fewbits.api: quantised layers run on %s", ", ".join(f"{n} x {k}" for k, n in counts.items()))
    return counts


def kernels_in_use(model: nn.Module) -> dict[str, int]:
    """How many QuantLinear layers of `model` run on each kernel ("cpu_int4pack", "reference", "cached", ...)."""
    counts: dict[str, int] = {}
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            name = kernel_name(mod.kernel)
            counts[name] = counts.get(name, 0) + 1
    return counts


def plan_model(model: nn.Module, recipe: Recipe) -> list[LayerPlan]:
    """The recipe's plan for this model; raises before anything changes (misfits, unknown methods).
    Fused mixture-of-experts weights are split into one linear per expert projection first (an exact
    rearrangement, `fewbits.models.moe`), so recipes name each expert's linears."""
    unfuse_experts(model)
    plans = recipe.plan(linear_shapes(model))
    unknown = sorted({p.method for p in plans if p.action == "quantize" and p.method not in METHODS})
    if unknown:
        raise QuantizeError(f"unknown method(s) {', '.join(unknown)}; available: {', '.join(METHODS)}")
    return plans


def quantize(model: nn.Module, recipe: Recipe | str, data: torch.Tensor | CalibrationData | None = None,
             progress: bool = True, chooser: KernelChooser | str | None = None,
             method: str | MethodConfig | None = None) -> QuantizeReport:
    """Quantise `model` in place with `recipe` (or a format spec such as "int4-g64", by `method`: a name
    such as "gptq" or a typed config such as ``GPTQ(damp=0.02)``; default "rtn").

    data: calibration for the methods that need it: `calibration_data(tokenizer, ...)` (its source is
    recorded in the report) or token ids (samples, seq_len).  Every layer is planned first (a misfit or
    unknown method raises before any layer changes); then each method's runner quantises its layers one
    at a time.  Returns a `QuantizeReport`.

    chooser: how the quantised layers run once the model is complete (`use_kernels`): None gives the
    kernel dispatcher ("auto": fast paths, bf16 activations on the CPU's int4/int8 kernels), ready for
    generation; "cached" (or `kernel_chooser("cached")`) keeps the exact dequantised weights, for quality
    measurements; "reference" prepares nothing (dequantise on every call), for a model that is only saved.
    While the method runs, layers use the reference path whatever the choice.
    """
    if isinstance(recipe, str):
        recipe = Recipe.from_format(recipe, method if method is not None else "rtn")
    elif method is not None:
        raise QuantizeError("method= goes with a format spec; a Recipe names the method of each rule")
    calibration = None
    if isinstance(data, CalibrationData):
        data, calibration = data.ids, data.describe()
    elif isinstance(data, torch.Tensor):
        calibration = describe_ids(data)
    t0 = time.perf_counter()
    plans = plan_model(model, recipe)
    todo = [p for p in plans if p.action == "quantize"]
    check_before_quantize(model, todo, data)
    configs = list(dict.fromkeys((p.method, p.config) for p in todo if p.config is not None))
    size_before = model_nbytes(model)
    before = {p.name: _weight_bytes(model.get_submodule(p.name)) for p in plans}
    after: dict[str, int] = {}
    planned = {p.name: p for p in todo}
    tied = tied_parameters(model)

    def commit(name: str, q: QuantizedTensor | nn.Module) -> None:
        if name not in planned:
            raise QuantizeError(f"layer {name} was not planned for quantisation")
        if name in after:
            raise QuantizeError(f"layer {name} was committed twice")
        new = swap_in(model, name, q, reference_chooser, tied)  # the chosen kernels are prepared at the end
        after[name] = q.nbytes if isinstance(q, QuantizedTensor) else model_nbytes(new)

    info: dict[str, Any] = {}
    method = ""
    try:
        for method in dict.fromkeys(p.method for p in todo):
            layers = [p for p in todo if p.method == method]
            out = METHODS[method].load()(model, layers, data, commit, progress)
            if out:
                info[method] = out
        missing = [p.name for p in todo if p.name not in after]
        if missing:
            raise QuantizeError(f"method(s) did not quantise {len(missing)} planned layer(s): "
                                f"{', '.join(missing[:8])}")
    except BaseException as exc:
        if after or method not in READ_ONLY_METHODS:  # else nothing changed: such a method only reads weights
            stopped_half_way(model, exc, method, len(after), len(todo))
        raise
    use_kernels(model, chooser)
    rows = [{"name": p.name, "shape": list(p.shape), "action": p.action, "format": p.format, "method": p.method,
             "note": p.note, "bytes_before": before[p.name], "bytes_after": after.get(p.name, before[p.name])}
            for p in plans]
    return QuantizeReport(size_before, model_nbytes(model), rows, time.perf_counter() - t0, recipe.to_dict(), info,
                          calibration, [{**c.to_dict(), "method": m} for m, c in configs])


#: methods that change nothing in the model until they commit a layer (the others fold scales or stage
#: quantised values into the float weights as they go)
READ_ONLY_METHODS = frozenset({"rtn", "hqq", "llm-int8"})


def check_before_quantize(model: nn.Module, todo: Sequence[LayerPlan], data: torch.Tensor | None) -> None:
    """Every check that can fail, run before any layer changes, so that a refused model is left exactly as
    it was: calibration data for the methods that need it, then each layer (`guard.check_layers`)."""
    from fewbits.calib.runner import check_calibration_data

    for method in dict.fromkeys(p.method for p in todo):
        if METHODS[method].needs_data:
            if data is None:
                raise QuantizeError(f"method {method} needs calibration data (token ids); none was given")
            check_calibration_data(data, method)
    check_layers(model, todo)


def _weight_bytes(mod: nn.Module) -> int:
    w = getattr(mod, "weight", None)
    return w.numel() * w.element_size() if w is not None else model_nbytes(mod)


# ---------------------------------------------------------------------- saving and loading
def save_quantized_model(model: nn.Module, recipe: Recipe, out_dir: str | os.PathLike[str], tokenizer: Any = None,
                         report: QuantizeReport | None = None, source: str | None = None,
                         overwrite: bool = False, extra: Mapping[str, str | bytes] | None = None) -> Path:
    """Write `model` (after `quantize`) to `out_dir`: config.json, tokenizer files, model.safetensors
    (every parameter and packed buffer, tied weights once) and fewbits.json (versioned: recipe,
    each replaced layer's description: kind and parameters such as format, act_bits, outlier_threshold;
    sizes).  Written in a temporary directory beside `out_dir`, then renamed into place; an existing
    `out_dir` is replaced only with `overwrite=True`.  `extra`: more files (name -> contents) written inside
    the same atomic write (a budgeted mix's recipe.toml and budget.json)."""
    from safetensors.torch import save_file

    refuse_if_unusable(model, "save")
    out = check_output(out_dir, overwrite)  # before the tensors are gathered
    tensors, aliases = _dedup_state(model)
    layers = describe_layers(model)
    dtypes = {str(t.dtype) for n, t in model.named_parameters()}
    meta = {"format": SAVED_FORMAT, "version": SAVED_VERSION, "model_class": type(model).__name__,
            "dtype": str(next(iter(model.parameters())).dtype).removeprefix("torch.") if dtypes else "float32",
            "source": source, "recipe": recipe.to_dict(), "layers": layers, "tied": aliases,
            "size_bytes": model_nbytes(model), "report": report.to_dict() if report is not None else None}
    if has_routed_experts(model):  # the loader splits the fused experts of the rebuilt model the same way
        meta["experts"] = "unfused"

    def write(tmp: Path) -> None:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        save_file({k: owned(v) for k, v in tensors.items()}, tmp / WEIGHTS_FILE,
                  metadata={"fewbits": json.dumps({"format": SAVED_FORMAT, "version": SAVED_VERSION})})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))

    return write_dir(out, write, overwrite, kind=SAVED_FORMAT, extra=extra)


def _dedup_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """state_dict with each storage once; aliases maps a dropped name to the name kept."""
    kept: dict[str, torch.Tensor] = {}
    first: dict[tuple[int, int, tuple[int, ...]], str] = {}
    aliases: dict[str, str] = {}
    for k, v in model.state_dict().items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset(), tuple(v.shape)) if v.numel() else (id(v), 0, ())
        if key in first:
            aliases[k] = first[key]
        else:
            first[key] = k
            kept[k] = v
    return kept, aliases


def quantize_streamed(path: str | os.PathLike[str], recipe: Recipe | str, out: str | os.PathLike[str],
                      data: torch.Tensor | CalibrationData | None = None, tokenizer: Any = None,
                      dtype: Any = "float32", progress: bool = True, overwrite: bool = False,
                      source: str | None = None) -> QuantizeReport:
    """`quantize` then `save_quantized_model` for a checkpoint bigger than memory: the safetensors model
    directory `path` is read, quantised and written to `out` one decoder block at a time (`fewbits.stream`);
    the same output, loaded by `load_quantized_model`."""
    from fewbits.stream import quantize_streamed as run

    return run(path, recipe, out, data=data, tokenizer=tokenizer, dtype=dtype, progress=progress,
               overwrite=overwrite, source=source)


def load_quantized_model(path: str | os.PathLike[str], chooser: KernelChooser | str | None = None
                         ) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Read a directory written by `save_quantized_model` -> (model in eval mode, tokenizer or None, meta).

    chooser: how the quantised layers run (`use_kernels`, prepared once the weights are in): None gives
    the kernel dispatcher ("auto": fast paths, bf16 activations on the CPU's int4/int8 kernels); pass
    "cached" for the exact dequantised weights (evaluation), "reference" to dequantise on every call."""
    import transformers
    from safetensors import safe_open
    from transformers.initialization import no_init_weights

    d = Path(path)
    meta = read_saved_meta(d)
    check_integrity(d)  # sizes and sha256 against the manifest, before anything is built
    wf = d / WEIGHTS_FILE
    if not wf.is_file():
        raise SavedModelError(f"{d}: weight file {WEIGHTS_FILE} is missing")
    try:
        with safe_open(str(wf), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # safetensors raises its own types for truncated or garbled files
        raise SavedModelError(f"{wf}: corrupt weight file ({' '.join(str(e).split())[:300]})") from e
    check_finite(tensors, wf)
    from fewbits.models.loading import refuse_remote_code

    refuse_remote_code(d)  # no Python from the folder is ever run: an auto_map is refused by name
    try:
        config = transformers.AutoConfig.from_pretrained(d, trust_remote_code=False)
    except Exception as e:  # transformers' own errors for a missing or garbled config.json
        raise SavedModelError(f"{d}: config.json cannot be read ({type(e).__name__}: {str(e)[:160]})") from None
    cls = getattr(transformers, meta["model_class"], None)
    if not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
        raise SavedModelError(f"{d}: model class {meta['model_class']!r} is not a transformers model class")
    archs = getattr(config, "architectures", None) or []
    if archs and meta["model_class"] not in archs:
        raise SavedModelError(f"{d}: {META_FILE} says {meta['model_class']}, config.json says {', '.join(archs)}")
    try:
        with no_init_weights():
            model = cls._from_config(config, dtype=getattr(torch, meta["dtype"]))
    except Exception as e:
        raise SavedModelError(f"{d}: {meta['model_class']} cannot be built from config.json "
                              f"({type(e).__name__}: {str(e)[:160]})") from None
    if meta.get("experts") == "unfused":
        unfuse_experts(model, copy=False)  # the saved tensors are per expert; their values come with them
    for name, lmeta in meta["layers"].items():
        try:
            want = tuple(model.get_submodule(name).weight.shape)
        except AttributeError:
            raise SavedModelError(f"{wf}: layer {name[:80]} is not a linear layer of {meta['model_class']}") from None
        try:
            new = rebuild_layer(lmeta, tensors, name)  # the reference path until the weights are in
        except LayerMetaError as e:
            raise SavedModelError(f"{wf}: {e}") from e
        except (AttributeError, TypeError, KeyError, ValueError) as e:
            raise SavedModelError(f"{wf}: layer {name}: malformed description ({type(e).__name__}: {e})") from None
        if (new.out_features, new.in_features) != want:
            raise SavedModelError(f"{wf}: layer {name} was saved with shape {(new.out_features, new.in_features)}, "
                                  f"the model's layer has {want}")
        swap_in(model, name, new)
    try:
        missing, unexpected = model.load_state_dict(tensors, strict=False)
    except RuntimeError as e:  # a tensor of the wrong shape
        raise SavedModelError(f"{wf}: does not match the model ({str(e).strip().splitlines()[-1][:200]})") from None
    missing = [k for k in missing if k not in meta["tied"]]
    if missing or unexpected:
        raise SavedModelError(f"{wf}: does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if meta["tied"]:
        model.tie_weights()  # the architecture's own tying, as from_pretrained does
        state = model.state_dict()
        for alias, name in meta["tied"].items():
            if alias not in state or name not in state:
                raise SavedModelError(f"{d}: {META_FILE} ties {alias[:80]!r} to {name[:80]!r}, "
                                      "which the model does not have")
            if state[alias].shape != state[name].shape:
                raise SavedModelError(f"{d}: {META_FILE} ties {alias} to {name} of another shape")
            if state[alias].data_ptr() != state[name].data_ptr():
                state[alias].copy_(state[name])  # the architecture did not tie them itself
    use_kernels(model, chooser)
    tokenizer = None
    if any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.txt")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(d, trust_remote_code=False)
    return model.eval(), tokenizer, meta


def load_checkpoint(path: str | os.PathLike[str], chooser: KernelChooser | str | None = None
                    ) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Any checkpoint `fewbits eval` scores -> (model in eval mode, tokenizer or None, info).

    A fewbits directory loads as `load_quantized_model` does (with `chooser`); a GGUF file, a
    compressed-tensors, GPTQ or AWQ directory loads dequantised (models/external.py).  info: "kind",
    "format", "method", "bits_per_weight" of the quantised linear weights, "size_bytes", "source" (the
    model it was made from, where the checkpoint records it)."""
    from fewbits.models.external import checkpoint_kind, load_external
    from fewbits.models.swap import model_nbytes

    if checkpoint_kind(path) != "fewbits":
        model, info = load_external(path)
        return model, None, {**info, "size_bytes": info.get("file_bytes"), "source": None}
    model, tok, meta = load_quantized_model(path, chooser)
    rules = Recipe.from_dict(meta["recipe"]).rules
    return model, tok, {"kind": "fewbits", "format": ", ".join(sorted({r.format for r in rules})),
                        "method": ", ".join(sorted({r.method for r in rules})), "source": meta.get("source"),
                        "bits_per_weight": (meta.get("report") or {}).get("bits_per_weight"),
                        "size_bytes": model_nbytes(model), "meta": meta}
