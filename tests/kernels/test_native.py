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


@pytest.mark.skipif(shutil.which("c++") is None or platform.machine().lower() not in ("x86_64", "amd64")
                    or not native.shims_supported(), reason="operators not built here, or no C shims in this torch")
def test_every_operator_a_compiled_step_can_hold_has_a_shim() -> None:
    """Each operator with a fake implementation (what lets it sit in a compiled graph) is called through a C shim:
    one left out would silently go back to the dispatcher."""
    assert cpu_int4.available() and rows.available() and kvkernel.available()
    names = {op.name() for op in native.c_shims()}
    want = {"fewbits_q4::q4_mm", "fewbits_q4::q4_mm_at", "fewbits_q4::q4_dequant", *rows.fakes(),
            "fewbits_kv::attend_kv", "fewbits_kv::attend_rows", "fewbits_kv::append_kv"}
    assert want <= names, sorted(want - names)


SHIM_SRC = r"""
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

at::Tensor mix(const at::Tensor& x, const c10::optional<at::Tensor>& y, int64_t k, double f, bool neg) {
  at::Tensor out = x.mul(f).add(k);
  if (y.has_value()) out = out.add(*y);
  return neg ? out.neg() : out;
}
void bump(const at::Tensor& x, at::Tensor& acc) { acc.add_(x); }
at::Tensor pick(const at::Tensor& x, at::IntArrayRef idx) { return x.narrow(0, idx[0], 1); }
at::Tensor other_name(const at::Tensor& x) { return x.add(1); }

TORCH_LIBRARY(fewbits_shim_test, m) {
  m.def("mix(Tensor x, Tensor? y, int k, float f, bool neg) -> Tensor");
  m.impl("mix", c10::DispatchKey::CPU, &mix);
  m.def("bump(Tensor x, Tensor(a!) acc) -> ()");
  m.impl("bump", c10::DispatchKey::CPU, &bump);
  m.def("pick(Tensor x, int[] idx) -> Tensor");
  m.impl("pick", c10::DispatchKey::CPU, &pick);
  m.def("plus_one(Tensor x) -> Tensor");
  m.impl("plus_one", c10::DispatchKey::CPU, &other_name);
}
"""
SHIM_NS = "fewbits_shim_test"


def test_shims_cover_the_types_the_wrapper_passes_and_skip_the_rest() -> None:
    """A shim per operator whose schema holds tensors, optional tensors, ints, floats and bools and returns one
    tensor or nothing; a list argument, or an operator registered under a function of another name, keeps the
    dispatcher."""
    _, decls = native.shim_source(SHIM_SRC, [f"{SHIM_NS}::{op}" for op in ("mix", "bump", "pick", "plus_one")])
    assert decls == {
        f"{SHIM_NS}::mix": "AOTITorchError aoti_torch_cpu_mix(AtenTensorHandle a0, AtenTensorHandle* a1, int64_t a2, "
                           "double a3, int32_t a4, AtenTensorHandle* ret0)",
        f"{SHIM_NS}::bump": "AOTITorchError aoti_torch_cpu_bump(AtenTensorHandle a0, AtenTensorHandle a1, "
                            "AtenTensorHandle* ret0)",
    }


@pytest.mark.skipif(shutil.which("c++") is None or not native.shims_supported(),
                    reason="no C++ compiler, or a torch without C shims for custom operators")
def test_a_compiled_graph_calls_the_shims_and_computes_what_the_operators_do(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """Built with shims, a graph compiled with inductor's C++ wrapper calls each operator through its shim (the
    arguments as the wrapper passes them: a tensor's handle, an optional tensor's pointer or nullptr, 0 / 1 for a
    bool) and gets what the operators compute when called from Python."""
    import torch._inductor.config as icfg

    from fewbits.decode.runner import compile_scope

    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    fake = lambda x, *a: torch.empty_like(x)  # noqa: E731
    ops = {f"{SHIM_NS}::mix": fake, f"{SHIM_NS}::bump": lambda x, acc: None}
    assert native.build(SHIM_NS, SHIM_SRC, ops, shims=True), native.why(SHIM_NS)
    shims = {op: decl for op, decl in native.c_shims().items() if op.namespace == SHIM_NS}
    assert sorted(op.name() for op in shims) == [f"{SHIM_NS}::bump", f"{SHIM_NS}::mix"]
    lib = torch.ops.fewbits_shim_test

    def f(x: torch.Tensor, y: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
        a = lib.mix(x, y, 3, 0.5, True)
        b = lib.mix(x + 1, None, -2, 2.0, False)
        lib.bump(a, acc)
        return a + b

    x, y = torch.randn(5), torch.randn(5)
    acc0 = torch.randn(5)
    want_acc = acc0.clone()
    want = f(x, y, want_acc)
    got_acc = acc0.clone()
    with compile_scope(tmp_path / "inductor"), icfg.patch({"cpp_wrapper": True,
                                                           "aot_inductor.custom_ops_to_c_shims": shims}):
        got = torch.compile(f, fullgraph=True)(x, y, got_acc)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_acc, want_acc)
    wrappers = [p.read_text() for p in (tmp_path / "inductor").rglob("*.cpp") if "inductor_entry_impl" in p.read_text()]
    assert wrappers, "no C++ wrapper was written"
    code = "\n".join(wrappers)
    assert "aoti_torch_cpu_mix(" in code and "aoti_torch_cpu_bump(" in code
    assert f'aoti_torch_call_dispatcher("{SHIM_NS}' not in code
