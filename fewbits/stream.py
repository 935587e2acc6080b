"""Quantise a checkpoint that does not fit in memory: read it block by block from disk, write it block by
block, hold about one decoder block (plus the calibration activations) at any time.

    report = quantize_streamed("/models/llama-3-8b", "int4-g128", "llama-int4", dtype="bf16")
    report = quantize_streamed(d, Recipe.from_format("int4-g128", "gptq"), out, data=ids, tokenizer=tok)

The output is the folder `api.save_quantized_model` writes (config.json, tokenizer files, one
model.safetensors, fewbits.json, the manifest) and loads with `api.load_quantized_model`; it is written
inside `fewbits.files.write_dir`'s temporary folder, so a failure at any block leaves no partial output.

How one pass goes (`models.lazy.LazyModel` holds the weightless model and reads modules from disk):
- No calibrated method: each decoder block is read, every method runs over the block's planned layers
  (the methods' own runners, given one block's layers at a time), the block is written and freed.
- One calibrated method (GPTQ, AWQ, awq+gptq, SmoothQuant): its runner runs once over all its layers in
  the blocks, as in memory; the block runner (`calib.runner.iterate_blocks`) calls this module's hooks,
  which read a block before it is calibrated and write and free it once it is quantised and its outputs
  are taken.  Methods without data planned for the same block run when the block is read (those the
  recipe lists before the calibrated one) or before it is written (those after), the order in which
  `api.quantize` would have applied them.  Layers of the calibrated method outside the blocks are
  rounded to nearest by `calib.pipeline.commit_outside`, as every calibrated runner does there.
  Two calibrated methods in one recipe would need two passes over the checkpoint: refused.
- Outside the blocks: a planned layer (a quantised head) is read, quantised and written; everything else
  (embedding, final norm, an unquantised head) is copied from the checkpoint a few rows at a time, cast
  to the model's dtype, never whole.  A tied head is stored once, as `save_quantized_model` does.
The calibration pass reads the input embedding for the capture of block 0's inputs and frees it after.
Each planned layer is checked (`guard.check_layers`) when its block is read, not all up front: that would
be one more pass over the checkpoint, and a refused layer leaves no output anyway.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from fewbits.data.calibration import CalibrationData, describe_ids
from fewbits.guard import QuantizeError
from fewbits.models.lazy import LazyModel, state_names
from fewbits.models.recipe import LayerPlan, Recipe
from fewbits.tensor import QuantizedTensor

log = logging.getLogger("fewbits.stream")

#: `fewbits quantize` streams by itself when the model in its dtype would take more than this share of
#: the memory available (an in-memory quantisation peaks near the model's bytes plus the interpreter)
AUTO_STREAM_SHARE = 0.5


def model_bytes_on_disk(path: str | os.PathLike[str], dtype: Any = "float32") -> int:
    """Bytes the checkpoint at `path` takes in memory with its floating tensors in `dtype`."""
    from fewbits.models.lazy import CheckpointIndex
    from fewbits.models.loading import _torch_dtype

    size = torch.empty((), dtype=_torch_dtype(dtype)).element_size()
    total = 0
    for e in CheckpointIndex(path).entries.values():
        n = torch.Size(e.shape).numel()
        total += n * size if e.dtype.is_floating_point else e.nbytes
    return total


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def should_stream(path: str | os.PathLike[str], dtype: Any = "float32") -> bool:
    """True when the model at `path` in `dtype` would take more than AUTO_STREAM_SHARE of available memory."""
    avail = available_memory()
    return avail is not None and model_bytes_on_disk(path, dtype) > AUTO_STREAM_SHARE * avail


def quantize_streamed(path: str | os.PathLike[str], recipe: Recipe | str, out: str | os.PathLike[str],
                      data: torch.Tensor | CalibrationData | None = None, tokenizer: Any = None,
                      dtype: Any = "float32", progress: bool = True, overwrite: bool = False,
                      source: str | None = None) -> Any:
    """Quantise the safetensors checkpoint in directory `path` with `recipe` (or a format spec such as
    "int4-g128") and save it to `out` as `api.save_quantized_model` would, reading and writing one decoder
    block at a time.  `data`: calibration for the calibrated methods (`api.calibration_data(...)`, or token
    ids (n, seq_len)), recorded in the report as `api.quantize` records it; `tokenizer`
    is saved beside the model.  Returns the `api.QuantizeReport` (also stored in fewbits.json)."""
    from fewbits.api import plan_model
    from fewbits.calib import distributed
    from fewbits.files import check_output, write_dir
    from fewbits.saved import SAVED_FORMAT

    if isinstance(recipe, str):
        recipe = Recipe.from_format(recipe)
    writes = distributed.rank() == 0 and int(os.environ.get("RANK", "0")) == 0  # under torchrun rank 0 writes
    if writes:
        out = check_output(out, overwrite)  # before any work
    calibration = None
    if isinstance(data, CalibrationData):
        data, calibration = data.ids, data.describe()
    elif isinstance(data, torch.Tensor):
        calibration = describe_ids(data)
    lazy = LazyModel.open(path, dtype)
    run = _Stream(lazy, plan_model(lazy.model, recipe), recipe, data, progress, source or str(path))
    run.calibration = calibration  # recorded in the report, as api.quantize records it
    if not writes:
        return run.run(None)
    report: list[Any] = []
    write_dir(out, lambda tmp: report.append(run.run(tmp, tokenizer)), overwrite, kind=SAVED_FORMAT)
    return report[0]


class _NullWriter:
    """Stands in for the file on ranks that only calibrate."""

    nbytes = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        self.nbytes += t.numel() * t.element_size()

    def add_pieces(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], pieces: Any) -> None:
        for p in pieces:
            self.nbytes += p.numel() * p.element_size()


class _EmbeddingRows(nn.Module):
    """An embedding holding only some rows: token id -> its row's index (`lookup`) -> the table's forward."""

    def __init__(self, table: nn.Module, lookup: torch.Tensor) -> None:
        super().__init__()
        self.table, self.lookup = table, lookup

    def forward(self, ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.table(self.lookup.to(ids.device)[ids], *args, **kwargs)


class _Stream:
    """One streamed quantisation: the plan, the hooks `calib.runner.iterate_blocks` calls, the output."""

    def __init__(self, lazy: LazyModel, plans: list[LayerPlan], recipe: Recipe, data: torch.Tensor | None,
                 progress: bool, source: str) -> None:
        from fewbits.api import METHODS
        from fewbits.calib.runner import check_calibration_data, decoder_blocks

        self.lazy, self.model, self.plans, self.recipe = lazy, lazy.model, plans, recipe
        self.progress, self.source = progress, source
        self.todo = [p for p in plans if p.action == "quantize"]
        self.configs = list(dict.fromkeys((p.method, p.config) for p in self.todo if p.config is not None))
        self.calibration: dict[str, Any] | None = None
        self.planned = {p.name: p for p in self.todo}
        order = list(dict.fromkeys(p.method for p in self.todo))
        calibrated = [m for m in order if METHODS[m].needs_data]
        if len(calibrated) > 1:
            raise QuantizeError(f"streaming runs one calibrated method per recipe (one pass over the checkpoint); "
                                f"this recipe has {', '.join(calibrated)}")
        self.calibrated = calibrated[0] if calibrated else None
        if self.calibrated and data is None:  # the words of api.quantize
            raise QuantizeError(f"method {self.calibrated} needs calibration data (token ids); none was given")
        self.data = check_calibration_data(data, self.calibrated) if self.calibrated else None
        cut = order.index(self.calibrated) if self.calibrated else len(order)
        self.before, self.after = order[:cut], order[cut + 1:]
        self.prefix, blocks, _ = decoder_blocks(self.model)
        self.blocks = [f"{self.prefix}.{i}" for i in range(len(blocks))]
        self.by_unit: dict[str, list[LayerPlan]] = {}  # a block or an outside layer -> its planned layers
        for p in self.todo:
            unit = next((b for b in self.blocks if p.name.startswith(b + ".")), p.name)
            self.by_unit.setdefault(unit, []).append(p)
        self.after_bytes: dict[str, int] = {}
        self.info: dict[str, Any] = {}
        self.layers: dict[str, dict[str, Any]] = {}
        self.done: set[str] = set()
        self.writer: Any = _NullWriter()

    # ------------------------------------------------------------------ what a method runner hands over
    def commit(self, name: str, q: QuantizedTensor | nn.Module) -> None:
        from fewbits.models.qlinear import reference_chooser
        from fewbits.models.swap import model_nbytes, swap_in

        if name not in self.planned:
            raise QuantizeError(f"layer {name} was not planned for quantisation")
        if name in self.after_bytes:
            raise QuantizeError(f"layer {name} was committed twice")
        new = swap_in(self.model, name, q, reference_chooser, set())
        self.after_bytes[name] = q.nbytes if isinstance(q, QuantizedTensor) else model_nbytes(new)

    def _run_methods(self, unit: str, methods: Sequence[str]) -> None:
        from fewbits.api import METHODS
        from fewbits.calib.pipeline import commit_outside

        for m in methods:
            layers = [p for p in self.by_unit.get(unit, []) if p.method == m]
            if not layers:
                continue
            if m == self.calibrated:  # only outside the blocks: what the calibrated runner does there
                commit_outside(self.model, layers, self.commit, self.info.setdefault(m, {}))
                continue
            out = METHODS[m].load()(self.model, layers, None, self.commit, False)
            if out:
                self.info.setdefault(m, {}).update(out)

    # ------------------------------------------------------------------ hooks of calib.runner.iterate_blocks
    @contextmanager
    def capture(self) -> Iterator[None]:
        """While block 0's inputs are recorded: the rows of the input embedding for the calibration tokens
        (`_EmbeddingRows`; a 128k x 4096 table is 2 GB in float32, the rows of 128 x 2048 tokens a fraction),
        or the whole embedding where it is not a plain table of rows."""
        from fewbits.models.swap import replace_module

        emb = self.model.get_input_embeddings()
        name = next(n for n, m in self.model.named_modules() if m is emb)
        weight = getattr(emb, "weight", None)
        if not isinstance(emb, nn.Embedding) or weight is None or weight.dim() != 2 or emb.max_norm is not None:
            self.lazy.load(name)
            try:
                yield
            finally:
                self.lazy.free(name)
            return
        assert self.data is not None
        rows = torch.unique(self.data)  # sorted
        if int(rows[0]) < 0 or int(rows[-1]) >= weight.shape[0]:
            raise QuantizeError(f"calibration token ids run from {int(rows[0])} to {int(rows[-1])}; the embedding "
                                f"{name} has {weight.shape[0]} rows")
        table = copy.deepcopy(emb)  # the model's own class (e.g. Gemma's scaled embedding), fewer rows
        table.weight = nn.Parameter(self.lazy.read_rows(f"{name}.weight", rows), requires_grad=False)
        table.num_embeddings, table.padding_idx = int(rows.numel()), None  # padding_idx only matters for gradients
        lookup = torch.full((weight.shape[0],), -1, dtype=torch.long)
        lookup[rows] = torch.arange(rows.numel())
        replace_module(self.model, name, _EmbeddingRows(table, lookup))
        try:
            yield
        finally:
            replace_module(self.model, name, emb)

    def enter(self, i: int) -> None:
        """Read block i; check its planned layers; run the methods the recipe lists before the calibrated one."""
        from fewbits.guard import check_layers

        unit = self.blocks[i]
        if unit in self.done or self.lazy.is_loaded(unit):
            return
        self.lazy.load(unit)
        check_layers(self.model, self.by_unit.get(unit, []))
        self._run_methods(unit, self.before)

    def leave(self, i: int) -> None:
        """Run the methods listed after the calibrated one on block i, then write it and free it."""
        unit = self.blocks[i]
        if unit in self.done:
            return
        self._run_methods(unit, self.after)
        self._write_unit(unit)

    # ------------------------------------------------------------------ the pass
    def _write_unit(self, unit: str) -> None:
        from fewbits.models.qlinear import describe_layer, describe_layers

        mod = self.model.get_submodule(unit)
        d = describe_layer(mod, unit)
        if d is not None:
            self.layers[unit] = d
        else:
            self.layers.update({f"{unit}.{k}": v for k, v in describe_layers(mod).items()})
        for k, t in mod.state_dict(prefix=unit + ".").items():
            self.writer.add(k, t)
        self.lazy.free(unit)
        self.done.add(unit)
        _give_back_freed_memory()

    def _blocks(self) -> None:
        from fewbits.api import METHODS
        from fewbits.calib.runner import BLOCK_HOOKS_ATTR

        calib_layers = [p for p in self.todo if p.method == self.calibrated and p.name not in self.by_unit]
        if calib_layers:
            setattr(self.model, BLOCK_HOOKS_ATTR, self)
            try:
                out = METHODS[self.calibrated].load()(self.model, calib_layers, self.data, self.commit, self.progress)
            finally:
                delattr(self.model, BLOCK_HOOKS_ATTR)
            if out:
                self.info.setdefault(self.calibrated, {}).update(out)
        rest = [i for i, b in enumerate(self.blocks) if b not in self.done]  # all, or those past the last calibrated
        for i in tqdm(rest, desc="stream", unit="block", disable=not self.progress or not rest, leave=False):
            self.enter(i)
            self.leave(i)

    def _outside(self, aliases: dict[str, str]) -> None:
        """Planned layers outside the blocks, then every other tensor copied from the checkpoint."""
        from fewbits.guard import check_layers

        for unit in self.by_unit:
            if unit in self.blocks:
                continue
            self.lazy.load(unit)
            check_layers(self.model, self.by_unit[unit])
            self._run_methods(unit, [*self.before, *([self.calibrated] if self.calibrated else []), *self.after])
            self._write_unit(unit)
        skeleton = self.model.state_dict(keep_vars=True)
        for k in self._pass_through():
            if k in aliases:
                continue
            t = skeleton[k]
            src = self.lazy.source.get(k)
            if src is None:
                if t.device.type == "meta":
                    raise ValueError(f"{k}: neither in the checkpoint nor computed by the model")
                self.writer.add(k, t)
                continue
            cast = t.dtype if t.is_floating_point() and self.lazy.index.entries[src].dtype.is_floating_point else None
            dtype = cast or self.lazy.index.entries[src].dtype
            self.writer.add_pieces(k, dtype, tuple(t.shape),
                                   (p if cast is None else p.to(cast) for p in self.lazy.index.rows(src)))

    def _pass_through(self) -> list[str]:
        """State-dict names of the skeleton outside every block and every planned outside layer, in order."""
        units = [u + "." for u in (*self.blocks, *self.by_unit)]
        return [k for k in self.model.state_dict(keep_vars=True) if not k.startswith(tuple(units))]

    def _aliases(self) -> dict[str, str]:
        """Copied tensors tied to an earlier copied one: stored once, named in fewbits.json's "tied"."""
        groups = state_names(self.model)
        passing = set(self._pass_through())
        out: dict[str, str] = {}
        for k in passing:
            first = next(n for n in groups[k] if n in passing)
            if first != k:
                out[k] = first
        return out

    def run(self, tmp: Path | None, tokenizer: Any = None) -> Any:
        """The whole pass; with `tmp`, the output folder's files are written there."""
        from fewbits.api import QuantizeReport, _weight_bytes
        from fewbits.saved import META_FILE, SAVED_FORMAT, SAVED_VERSION, WEIGHTS_FILE
        from fewbits.tensorfile import TensorFileWriter

        t0 = time.perf_counter()
        before = {p.name: _weight_bytes(self.model.get_submodule(p.name)) for p in self.plans}
        size_before = _skeleton_bytes(self.model)
        aliases = self._aliases()
        names = list(self.model.state_dict(keep_vars=True))
        if tmp is not None:
            self.model.config.save_pretrained(tmp)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
            self.writer = TensorFileWriter(tmp / WEIGHTS_FILE, n_tensors_hint=6 * len(names),
                                           longest_name=max(map(len, names), default=0) + 32)
        try:
            self._blocks()
            self._outside(aliases)
        except BaseException:
            if tmp is not None:
                self.writer.abort()
            raise
        missing = [p.name for p in self.todo if p.name not in self.after_bytes]
        if missing:
            raise QuantizeError(f"method(s) did not quantise {len(missing)} planned layer(s): {', '.join(missing[:8])}")
        rows = [{"name": p.name, "shape": list(p.shape), "action": p.action, "format": p.format, "method": p.method,
                 "note": p.note, "bytes_before": before[p.name],
                 "bytes_after": self.after_bytes.get(p.name, before[p.name])} for p in self.plans]
        report = QuantizeReport(size_before, self.writer.nbytes, rows, time.perf_counter() - t0,
                                self.recipe.to_dict(), self.info, self.calibration,
                                [{**c.to_dict(), "method": m} for m, c in self.configs])
        if tmp is not None:
            self.writer.close({"fewbits": json.dumps({"format": SAVED_FORMAT, "version": SAVED_VERSION})})
            first = next(iter(self.model.parameters()), None)
            meta = {"format": SAVED_FORMAT, "version": SAVED_VERSION, "model_class": type(self.model).__name__,
                    "dtype": str(first.dtype).removeprefix("torch.") if first is not None else "float32",
                    "source": self.source, "recipe": self.recipe.to_dict(), "layers": self.layers, "tied": aliases,
                    "size_bytes": self.writer.nbytes, "report": report.to_dict()}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1, default=str))
        return report


def _give_back_freed_memory() -> None:
    """glibc's malloc_trim(0) after each block: the block's freed tensors go back to the system instead of
    staying in the heap as fragments the next block's differently sized tensors do not fit (a streamed
    SmolLM2 GPTQ peaked at 0.73 GB instead of 0.81).  Changes no setting; nothing where there is no glibc."""
    global _TRIM
    if _TRIM is None:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        _TRIM = getattr(ctypes.CDLL(name), "malloc_trim", False) if name else False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None


def _skeleton_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and persistent buffer of a (meta) model, tied tensors once."""
    seen: set[int] = set()
    total = 0
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


__all__ = ["quantize_streamed", "should_stream", "model_bytes_on_disk", "available_memory", "AUTO_STREAM_SHARE"]
