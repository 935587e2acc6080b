"""Recipes: which layers get which format and which method.

A `Recipe` is a frozen value: an ordered list of rules (a regular expression over module names ->
format spec + method name), an ignore list (by default the LM head and the embeddings stay 16-bit),
and a policy for layers whose shape the format does not fit (``misfit``):

    error    refuse, naming every layer that does not fit (the default)
    keep     leave those layers unquantised
    regroup  use the largest group size <= the requested one that divides the layer's input width

`Recipe.plan(named_shapes)` turns a recipe and the model's linear layers into a list of
`LayerPlan`s *before* anything is changed, so a recipe that cannot work fails without side effects.
Recipes round-trip through dicts, JSON and TOML (`save` / `load` pick by file suffix).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fewbits.formats.format import MISFIT_POLICIES, Format, FormatError, parse_format
from fewbits.methods.config import MethodConfig, MethodConfigError
from fewbits.methods.registry import METHODS, resolve

RECIPE_VERSION = 1
Misfit = Literal["error", "keep", "regroup"]
#: module-name patterns left in 16-bit unless the recipe says otherwise
#: the output projection (LM head): kept 16-bit unless a recipe gives it a format (`from_format(lm_head=...)`)
LM_HEAD = r"(^|\.)lm_head$"
#: a mixture-of-experts router (`mlp.gate` where it is a linear layer) and Qwen2-MoE's shared-expert gate
#: (one output row) stay 16-bit too: they are tiny, and a small error in them changes which experts run
DEFAULT_IGNORE: tuple[str, ...] = (LM_HEAD, r"(^|\.)embed[^.]*$", r"(^|\.)(wte|wpe|word_embeddings)$",
                                   r"(^|\.)(mlp\.gate|shared_expert_gate)$")


class RecipeError(ValueError):
    """A recipe that cannot be read or cannot be applied to a model."""


@dataclass(frozen=True)
class Rule:
    """Layers whose full module name matches `pattern` (``re.search``) get `format` by `method`.

    method: a name in `fewbits.methods.registry.METHODS` with its `options` ({name: value}), or a typed
    config such as ``GPTQ(act_order=False)``.  The options are checked against the method's config class
    at once: an unknown or misspelled option, or a value of the wrong type, is a RecipeError naming it and
    the valid ones.  `config` is the typed config; `options` keeps only the fields that differ from the
    defaults (what `to_dict` writes).  A method missing from the registry keeps its options unchecked, and
    planning refuses it (`fewbits.api.plan_model`)."""

    pattern: str
    format: str
    method: str = "rtn"
    options: Mapping[str, Any] = field(default_factory=dict)
    config: MethodConfig | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise RecipeError(f"rule pattern {self.pattern!r} is not a regular expression: {e}") from None
        object.__setattr__(self, "format", parse_format(self.format).spec)  # canonical spelling
        config = None
        if isinstance(self.method, MethodConfig) or (isinstance(self.method, str) and self.method in METHODS):
            try:
                name, config = resolve(self.method, self.options)
            except MethodConfigError as e:
                raise RecipeError(f"rule {self.pattern!r}: {e}") from None
            object.__setattr__(self, "method", name)
            object.__setattr__(self, "options", config.options())
        else:
            object.__setattr__(self, "options", dict(self.options))
        object.__setattr__(self, "config", config)

    @property
    def fmt(self) -> Format:
        return parse_format(self.format)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"pattern": self.pattern, "format": self.format, "method": self.method}
        if self.options:
            d["options"] = dict(self.options)
        return d


@dataclass(frozen=True)
class LayerPlan:
    """What happens to one linear layer: action is "quantize", "keep" (misfit kept 16-bit) or "ignore"."""

    name: str
    shape: tuple[int, int]
    action: Literal["quantize", "keep", "ignore"]
    format: str | None = None
    method: str | None = None
    config: MethodConfig | None = None  # the method's typed options (`fewbits.methods.config`)
    note: str = ""

    @property
    def fmt(self) -> Format | None:
        return parse_format(self.format) if self.format else None

    @property
    def options(self) -> dict[str, Any]:
        """The options that differ from the method's defaults."""
        return self.config.options() if self.config is not None else {}


@dataclass(frozen=True)
class Recipe:
    """An ordered list of rules (first match wins), an ignore list and a misfit policy."""

    rules: tuple[Rule, ...]
    ignore: tuple[str, ...] = DEFAULT_IGNORE
    misfit: Misfit = "error"

    def __post_init__(self) -> None:
        object.__setattr__(self, "rules", tuple(r if isinstance(r, Rule) else Rule(**r) for r in self.rules))
        object.__setattr__(self, "ignore", tuple(self.ignore))
        if self.misfit not in MISFIT_POLICIES:
            raise RecipeError(f"misfit policy {self.misfit!r} is not one of {', '.join(MISFIT_POLICIES)}")
        for p in self.ignore:
            try:
                re.compile(p)
            except re.error as e:
                raise RecipeError(f"ignore pattern {p!r} is not a regular expression: {e}") from None
        if not self.rules:
            raise RecipeError("a recipe needs at least one rule")

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_format(cls, spec: str, method: str | MethodConfig = "rtn", misfit: Misfit = "error",
                    ignore: Iterable[str] = DEFAULT_IGNORE, lm_head: str | None = None) -> Recipe:
        """The common case: every linear layer (except the ignore list) in one format, by `method` (a name
        or a typed config such as ``GPTQ(damp=0.02)``).

        lm_head: a format for the output projection too (round to nearest; it is left out of the ignore
        list).  A head tied to the input embedding gets its own quantised copy: the embedding keeps its
        16-bit rows for the lookups, so the model holds more bytes but a decode step reads fewer (the head
        is read in full every step, the embedding one row per token)."""
        rules = (Rule(r".*", spec, method),)
        if lm_head is not None:
            rules = (Rule(LM_HEAD, lm_head, "rtn"), *rules)
            ignore = tuple(p for p in ignore if p != LM_HEAD)
        return cls(rules=rules, ignore=tuple(ignore), misfit=misfit)

    def with_misfit(self, misfit: Misfit) -> Recipe:
        return Recipe(self.rules, self.ignore, misfit)

    # ------------------------------------------------------------------ matching
    def rule_for(self, name: str) -> Rule | None:
        """The first rule whose pattern matches `name`, or None when the name is ignored/unmatched."""
        if any(re.search(p, name) for p in self.ignore):
            return None
        return next((r for r in self.rules if re.search(r.pattern, name)), None)

    def plan(self, named_shapes: Iterable[tuple[str, tuple[int, ...]]]) -> list[LayerPlan]:
        """Decide every layer's fate; raise RecipeError naming all misfits when the policy is "error"."""
        out: list[LayerPlan] = []
        misfits: list[str] = []
        for name, shape in named_shapes:
            shape2 = (int(shape[0]), int(shape[-1]))
            rule = self.rule_for(name)
            if rule is None:
                why = "ignore list" if any(re.search(p, name) for p in self.ignore) else "no rule matches"
                out.append(LayerPlan(name, shape2, "ignore", note=why))
                continue
            fmt = rule.fmt
            if not fmt.is_quantized:
                out.append(LayerPlan(name, shape2, "ignore", note=f"rule asks for {fmt.spec}"))
                continue
            try:
                fmt.check_shape(shape2, name)
            except FormatError as e:
                misfits.append(str(e))
                out.append(self._misfit_plan(name, shape2, rule, fmt))
                continue
            out.append(LayerPlan(name, shape2, "quantize", fmt.spec, rule.method, rule.config))
        if misfits and self.misfit == "error":
            head = f"{len(misfits)} layer(s) do not fit their format (use --misfit keep or --misfit regroup):\n  "
            raise RecipeError(head + "\n  ".join(_summarise(misfits)))
        return out

    def _misfit_plan(self, name: str, shape: tuple[int, int], rule: Rule, fmt: Format) -> LayerPlan:
        cols = shape[1]
        new = fmt.regrouped(cols) if self.misfit == "regroup" else None
        if new is not None:
            g = new.group_size
            note = f"regrouped: {cols} columns not divisible by {fmt.group_size}, group {g} used ({new.spec})"
            return LayerPlan(name, shape, "quantize", new.spec, rule.method, rule.config, note)
        why = f"kept 16-bit: {cols} columns not divisible by the group size {fmt.group_size} of {fmt.spec}"
        if self.misfit == "regroup":
            why += f" (the block size of {fmt.kind} is fixed)"
        return LayerPlan(name, shape, "keep", note=why)

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return {"version": RECIPE_VERSION, "misfit": self.misfit, "ignore": list(self.ignore),
                "rules": [r.to_dict() for r in self.rules]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Recipe:
        if not isinstance(d, Mapping):
            raise RecipeError(f"a recipe is a mapping, got {type(d).__name__}")
        version = d.get("version", RECIPE_VERSION)
        if version != RECIPE_VERSION:
            raise RecipeError(f"recipe version {version!r} is not supported (this fewbits reads {RECIPE_VERSION})")
        unknown = set(d) - {"version", "misfit", "ignore", "rules"}
        if unknown:
            raise RecipeError(f"recipe has unknown keys {sorted(unknown)}")
        raw_rules, ignore = d.get("rules", []), d.get("ignore", DEFAULT_IGNORE)
        if not isinstance(raw_rules, list) or not all(isinstance(r, Mapping) for r in raw_rules):
            raise RecipeError("recipe \"rules\" must be a list of tables (pattern, format, method, options)")
        if not isinstance(ignore, (list, tuple)) or not all(isinstance(p, str) for p in ignore):
            raise RecipeError("recipe \"ignore\" must be a list of patterns (strings)")
        rules = []
        for i, r in enumerate(raw_rules):
            extra = set(r) - {"pattern", "format", "method", "options"}
            if extra or "pattern" not in r or "format" not in r:
                raise RecipeError(f"recipe rule {i} needs 'pattern' and 'format' (and optional 'method', "
                                  f"'options'); got keys {sorted(map(str, r))[:8]}")
            method, options = r.get("method", "rtn"), r.get("options", {})
            if not all(isinstance(v, str) for v in (r["pattern"], r["format"], method)):
                raise RecipeError(f"recipe rule {i}: 'pattern', 'format' and 'method' must be strings")
            if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
                raise RecipeError(f"recipe rule {i}: 'options' must be a table of named values")
            try:
                rules.append(_checked(f"recipe rule {i}", Rule, r["pattern"], r["format"], method, dict(options)))
            except RecipeError as e:
                raise RecipeError(f"recipe rule {i}: {e}" if not str(e).startswith("recipe") else str(e)) from None
        if not isinstance(d.get("misfit", "error"), str):
            raise RecipeError("recipe \"misfit\" must be a string: error, keep or regroup")
        return _checked("recipe", cls, tuple(rules), tuple(ignore), d.get("misfit", "error"))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> Recipe:
        try:
            return cls.from_dict(json.loads(text))
        except (json.JSONDecodeError, RecursionError) as e:
            raise RecipeError(f"recipe is not valid JSON: {e}") from None

    def to_toml(self) -> str:
        lines = [f"version = {RECIPE_VERSION}", f"misfit = {_toml(self.misfit)}",
                 f"ignore = [{', '.join(_toml(p) for p in self.ignore)}]"]
        for r in self.rules:
            lines += ["", "[[rules]]", f"pattern = {_toml(r.pattern)}", f"format = {_toml(r.format)}",
                      f"method = {_toml(r.method)}"]
            if r.options:
                lines.append("options = {" + ", ".join(f"{k} = {_toml(v)}" for k, v in r.options.items()) + "}")
        return "\n".join(lines) + "\n"

    @classmethod
    def from_toml(cls, text: str) -> Recipe:
        import tomllib

        try:
            return cls.from_dict(tomllib.loads(text))
        except tomllib.TOMLDecodeError as e:
            raise RecipeError(f"recipe is not valid TOML: {e}") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write as TOML (``.toml``) or JSON (anything else), atomically."""
        from fewbits.files import write_text

        p = Path(path)
        text = self.to_toml() if p.suffix == ".toml" else self.to_json()
        write_text(p, text)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Recipe:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe file {p} does not exist")
        try:
            text = p.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecipeError(f"recipe file {p} is not UTF-8 text (byte {e.start})") from None
        except OSError as e:
            raise RecipeError(f"recipe file {p} cannot be read ({e.strerror})") from None
        return cls.from_toml(text) if p.suffix == ".toml" else cls.from_json(text)


def _checked(what: str, build: Any, *args: Any) -> Any:
    """build(*args); an error that is not one of fewbits' own (a bad regex, a wrong type) as a RecipeError."""
    try:
        return build(*args)
    except Exception as e:
        if (type(e).__module__ or "").startswith("fewbits"):
            raise
        raise RecipeError(f"{what}: {type(e).__name__}: {' '.join(str(e).split())[:200]}") from None


def _toml(v: Any) -> str:
    """A TOML literal for a str/bool/int/float (JSON string escapes are valid TOML basic strings)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    raise RecipeError(f"recipe option value {v!r} cannot be written to TOML (str, bool, int or float only)")


#: most lines a misfit error lists (one per kind of layer: the same name in every block counts once)
MISFIT_LINES = 8


def _summarise(misfits: list[str]) -> list[str]:
    """One line per kind of layer (block indices folded: model.layers.*.mlp.up_proj), the first layer's
    message with the count of the others, at most MISFIT_LINES lines."""
    kinds: dict[str, list[str]] = {}
    for m in misfits:
        name = m.split(": ", 1)[0]
        kinds.setdefault(re.sub(r"\.\d+\.", ".*.", name), []).append(m)
    lines = [ms[0] + (f" (and {len(ms) - 1} more {kind})" if len(ms) > 1 else "") for kind, ms in kinds.items()]
    if len(lines) > MISFIT_LINES:
        lines = lines[:MISFIT_LINES] + [f"... and {len(lines) - MISFIT_LINES} more kinds of layer"]
    return lines
