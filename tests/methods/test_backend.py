"""The calibration backend dispatcher: numba for CPU tensors when it imports, plain torch otherwise,
forced by an argument or FEWBITS_CALIB_BACKEND; impossible choices are clear errors."""

from __future__ import annotations

import pytest
import torch

from fewbits.methods import backend
from fewbits.methods.common import MethodError
from fewbits.methods.gptq import gptq_quantize


def test_auto_picks_numba_on_cpu_and_torch_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(backend.ENV, raising=False)
    monkeypatch.setattr(backend, "numba_available", lambda: True)
    assert backend.choose("cpu") == "numba"
    assert backend.choose(torch.device("cuda", 0)) == "torch"
    assert backend.choose("meta") == "torch"
    monkeypatch.setattr(backend, "numba_available", lambda: False)
    assert backend.choose("cpu") == "torch"


def test_argument_and_environment_force_a_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "numba_available", lambda: True)
    monkeypatch.setenv(backend.ENV, "torch")
    assert backend.choose("cpu") == "torch"
    assert backend.choose("cpu", "numba") == "numba"  # the argument wins over the environment
    monkeypatch.setenv(backend.ENV, " Numba ")
    assert backend.choose("cpu") == "numba"
    monkeypatch.setenv(backend.ENV, "auto")
    assert backend.choose("cpu") == "numba"


def test_impossible_or_misspelled_choices_are_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(backend.ENV, "numab")
    with pytest.raises(MethodError, match=r"FEWBITS_CALIB_BACKEND: unknown calibration backend 'numab'"):
        backend.choose("cpu")
    monkeypatch.delenv(backend.ENV)
    with pytest.raises(MethodError, match="CPU tensors only, these are on cuda"):
        backend.choose("cuda", "numba")
    monkeypatch.setattr(backend, "numba_available", lambda: False)
    with pytest.raises(MethodError, match="needs numba"):
        backend.choose("cpu", "numba")


def test_gptq_reports_a_bad_backend_before_any_work() -> None:
    w = torch.randn(8, 64)
    with pytest.raises(MethodError, match="unknown calibration backend 'gpu'"):
        gptq_quantize(w, torch.eye(64), "int4-g32", backend="gpu")
