"""The KV operators' C++ source as the build compiles it: kvkernel.cpp with its per-ISA parts written in."""

from __future__ import annotations

from pathlib import Path

from fewbits.decode import kvkernel

HERE = Path(kvkernel.__file__).parent


def test_every_part_is_written_in_once_and_none_is_left_named() -> None:
    parts = sorted(p.name for p in HERE.glob("kvkernel_*.inc"))
    assert parts == ["kvkernel_avx2.inc", "kvkernel_avx512.inc", "kvkernel_i16.inc", "kvkernel_vnni.inc"]
    main = (HERE / "kvkernel.cpp").read_text()
    assert sorted(kvkernel.PART.findall(main)) == parts  # each named once
    src = kvkernel.source()
    assert not kvkernel.PART.search(src) and "#include \"kvkernel_" not in src
    for name in parts:  # each part's text where its line stood, whole
        assert src.count((HERE / name).read_text()) == 1
    assert len(src) == len(main) + sum(len((HERE / n).read_text()) - len(f'#include "{n}"\n') for n in parts)
    # the ISA guards the operators test for come from the parts
    for macro in ("FEWBITS_KV_AVX512", "FEWBITS_KV_VNNI"):
        assert f"#define {macro} 1" in src and f"#define {macro} 1" not in main
