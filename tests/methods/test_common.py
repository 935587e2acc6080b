"""Each method names the formats it takes; others get an error naming the method and the format."""

from __future__ import annotations

import pytest

from fewbits.formats.format import FormatError
from fewbits.methods.common import METHOD_FORMATS, MethodError, check_method_format


@pytest.mark.parametrize("method,spec", [
    ("gptq", "nf4-g64"), ("gptq", "fp8-e4m3"), ("awq", "mxfp4"), ("awq+gptq", "fp4-g32"), ("hqq", "nvfp4"),
    ("smoothquant", "int4-g64"), ("llm-int8", "int8-g128"), ("smoothquant", "fp8-e4m3"), ("gptq", "bf16"),
])
def test_unsupported_pairs_are_refused(method: str, spec: str) -> None:
    with pytest.raises(MethodError) as e:
        check_method_format(method, spec)
    assert method in str(e.value) and spec in str(e.value)
    assert isinstance(e.value, FormatError)


@pytest.mark.parametrize("method,spec", [
    ("rtn", "nf4-g64"), ("rtn", "fp8-e4m3"), ("gptq", "int2-g64"), ("gptq", "int8"), ("gptq", "int4-g64-asym"),
    ("awq", "int3-g64"), ("awq+gptq", "int4-g128"), ("hqq", "int4-g64-asym"), ("smoothquant", "int8"),
    ("llm-int8", "int8"),
])
def test_supported_pairs_pass(method: str, spec: str) -> None:
    assert check_method_format(method, spec).spec == spec


def test_unknown_method() -> None:
    with pytest.raises(MethodError, match="unknown method 'gtpq'"):
        check_method_format("gtpq", "int4")
    assert set(METHOD_FORMATS) == {"rtn", "gptq", "awq", "awq+gptq", "hqq", "smoothquant", "llm-int8"}
