"""Every method `fewbits.api.quantize` runs: one explicit entry per method (its config class, whether it
needs calibration data, its runner), and the look-ups recipes and the CLI make in it.

A runner has the signature ``runner(model, layers, data, commit, progress) -> dict | None`` (see
`fewbits.api`); it is named here as "module:function" and imported only when the method runs, so this
table (and a recipe checked against it) loads without torch.  Add a method with one line in `METHODS`;
a plugged-in method (`METHODS["mine"] = MethodEntry("pkg.mod:runner")`) takes no options unless its entry
names a config class.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fewbits.methods.config import (
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


@dataclass(frozen=True)
class MethodEntry:
    """A method: its runner ("module:function"), whether it needs calibration data, its config class."""

    target: str
    needs_data: bool = False
    config: type[MethodConfig] = MethodConfig

    def load(self) -> Callable[..., Any]:
        module, attr = self.target.split(":")
        return getattr(importlib.import_module(module), attr)


#: method name -> entry; the names are what `--method` and a recipe rule's `method` accept
METHODS: dict[str, MethodEntry] = {
    "rtn": MethodEntry("fewbits.api:run_rtn", needs_data=False, config=RTN),
    "gptq": MethodEntry("fewbits.calib.pipeline:run_gptq", needs_data=True, config=GPTQ),
    "awq": MethodEntry("fewbits.calib.pipeline:run_awq", needs_data=True, config=AWQ),
    "awq+gptq": MethodEntry("fewbits.calib.pipeline:run_awq_gptq", needs_data=True, config=AWQGPTQ),
    "hqq": MethodEntry("fewbits.calib.pipeline:run_hqq", needs_data=False, config=HQQ),
    "smoothquant": MethodEntry("fewbits.calib.w8a8:run_smoothquant", needs_data=True, config=SmoothQuant),
    # outliers are found at run time: no calibration
    "llm-int8": MethodEntry("fewbits.calib.w8a8:run_llm_int8", needs_data=False, config=LLMInt8),
}


def unknown_method(name: str) -> MethodConfigError:
    return MethodConfigError(f"unknown method {name!r}; one of {', '.join(METHODS)}")


def config_for(method: str, options: Mapping[str, Any] | None = None) -> MethodConfig:
    """The typed config of `method` with `options` ({name: value}); an unknown method or option, or a value
    of the wrong type, is a MethodConfigError naming it."""
    if method not in METHODS:
        raise unknown_method(method)
    return METHODS[method].config.from_options(options or {}, method)


def resolve(method: str | MethodConfig, options: Mapping[str, Any] | None = None) -> tuple[str, MethodConfig]:
    """(name, config) for a method given by name (with options) or as a config (`GPTQ(damp=0.02)`)."""
    if isinstance(method, MethodConfig):
        if options:
            raise MethodConfigError(f"give the options of {type(method).__name__} in the config itself, "
                                    f"not also as options {sorted(options)}")
        if not method.method or method.method not in METHODS or METHODS[method.method].config is not type(method):
            raise MethodConfigError(f"{type(method).__name__} is not the config of a registered method; "
                                    f"pass the method's name (one of {', '.join(METHODS)})")
        return method.method, method
    if not isinstance(method, str):
        raise MethodConfigError(f"a method is a name (one of {', '.join(METHODS)}) or a config such as GPTQ(), "
                                f"got {type(method).__name__}")
    return method, config_for(method, options)


__all__ = ["METHODS", "MethodEntry", "config_for", "resolve", "unknown_method"]
