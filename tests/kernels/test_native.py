"""`fewbits.kernels.native.build`: a C++ operator compiled once, cached on disk, and not blocked by the lock
file of a build that was killed half-way."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from fewbits.bench import evict
from fewbits.decode import kvkernel
from fewbits.kernels import cpu_int4, native, rows

SRC = r"""
#include <ATen/core/Tensor.h>
#include <torch/library.h>

at::Tensor twice(const at::Tensor& x) { return x.mul(2); }

TORCH_LIBRARY(fewbits_native_test, m) {
  m.def("twice(Tensor x) -> Tensor");
  m.impl("twice", c10::DispatchKey::CPU, &twice);
}
"""


def test_a_stale_torch_lock_does_not_block_the_build(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    d = native.build_dir("fewbits_native_test", SRC, native.CFLAGS)
    d.mkdir(parents=True)
    (d / "lock").touch()  # what a build killed half-way leaves: torch's loader would wait on it forever
    assert native.build("fewbits_native_test", SRC, {"fewbits_native_test::twice": lambda x: torch.empty_like(x)}), \
        native.why("fewbits_native_test")
    assert not (d / "lock").exists()
    x = torch.arange(4.0)
    assert torch.equal(torch.ops.fewbits_native_test.twice(x), 2 * x)
    assert any(p.suffix == ".so" for p in d.iterdir())


@pytest.mark.skipif(shutil.which("c++") is None or platform.machine().lower() not in ("x86_64", "amd64"),
                    reason="no C++ compiler, or not an x86 CPU: the operators are not built here")
def test_every_operator_the_package_ships_builds() -> None:
    """Each module's tests skip where its operator is unavailable (a machine without a compiler), so a build error
    would show only as skipped tests: here, with a compiler on an x86 CPU, every operator must build."""
    built = {cpu_int4.NAME: cpu_int4.available(), rows.NAME: rows.available(), kvkernel.NAME: kvkernel.available(),
             evict.NAME: evict.available()}
    failed = {name: native.why(name) for name, ok in built.items() if not ok}
    assert not failed, f"operators that did not build: {failed}"
