"""`compile_scope`: what it changes only inside the block."""

from __future__ import annotations

import warnings
from pathlib import Path

from fewbits.decode.runner import MIXED_LOWP, compile_scope


def test_the_scope_hides_inductors_mixed_16bit_note_and_nothing_else(tmp_path: Path) -> None:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with compile_scope(tmp_path):
            warnings.warn(MIXED_LOWP + ".", UserWarning, stacklevel=1)  # inductor's text ends with a full stop
            warnings.warn("another warning", UserWarning, stacklevel=1)
        warnings.warn(MIXED_LOWP + ".", UserWarning, stacklevel=1)  # outside the scope: shown again
    assert [str(w.message) for w in seen] == ["another warning", MIXED_LOWP + "."]
