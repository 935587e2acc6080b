"""The playground's quantiser against the textbook formula of the reference document (seed 001):
s = max|w| / L per group, L = 2^(b-1) - 1, stored = s * clip(round(w / s), -L, L), in float64."""

from __future__ import annotations

import numpy as np
import pytest

from fewbits.eval.playground import default_weights, playground_spec, try_quantiser


def textbook(w: np.ndarray, bits: int, group: int) -> np.ndarray:
    L = 2 ** (bits - 1) - 1
    g = w.reshape(-1, group)
    scale = np.abs(g).max(axis=-1, keepdims=True) / L
    return (np.clip(np.round(g / scale), -L, L) * scale).reshape(w.shape)


@pytest.mark.parametrize("bits,group,outlier", [(8, 64, False), (4, 64, False), (4, 64, True), (4, 16, True),
                                                (4, 8, True), (3, 8, False), (2, 8, True)])
def test_symmetric_int_is_the_textbook_quantiser(bits: int, group: int, outlier: bool) -> None:
    r = try_quantiser(playground_spec("int", bits, group), outlier=outlier)
    w = default_weights(0, outlier)
    ref = textbook(w, bits, group)
    amax = np.repeat(np.abs(w.reshape(-1, group)).max(axis=-1), group)
    # fewbits keeps its scales in fp16 (relative rounding <= 2^-11): code * scale moves by <= amax * 2^-11
    assert np.all(np.abs(np.array(r.stored) - ref) <= amax * 2**-10)
    assert r.zeros == int(((ref == 0) & (w != 0)).sum())
    assert r.bits_per_weight == bits + 16 / group  # codes + one fp16 scale per group
    assert r.original == w.tolist()


def test_the_outlier_story_of_seed_001() -> None:
    """One scale over an outlier rounds many weights to zero; smaller groups contain the damage."""
    zeros = {g: try_quantiser(playground_spec("int", 4, g), outlier=True).zeros for g in (64, 16, 8)}
    plain = try_quantiser(playground_spec("int", 4, 64)).zeros
    assert zeros[64] > 3 * max(plain, 1) and zeros[8] < zeros[16] < zeros[64]


def test_pasted_weights_and_bad_input() -> None:
    w = np.linspace(-1, 1, 64)
    r = try_quantiser("int8-narrow", w)
    assert np.allclose(r.stored, textbook(w, 8, 64), atol=2**-10)
    with pytest.raises(ValueError, match="exactly 64"):
        try_quantiser("int8", w[:63])
    with pytest.raises(ValueError, match="finite"):
        try_quantiser("int8", np.full(64, np.nan))
    with pytest.raises(ValueError, match="int only"):
        playground_spec("nf4", 4, 64, asym=True)
    with pytest.raises(ValueError, match="group"):
        playground_spec("int", 4, 12)


def test_full_grid_puts_the_extreme_on_the_end_code() -> None:
    """fewbits' default grid (--full-grid): scale = the signed extreme / -2^(b-1), codes -8..7 at 4 bits."""
    spec = playground_spec("int", 4, 64, full_grid=True)
    assert spec == "int4"
    w = default_weights(0, False)
    r = try_quantiser(spec)
    ext = w[np.argmax(np.abs(w))]
    scale = ext / -8
    ref = np.clip(np.floor(w / scale + 0.5), -8, 7) * scale  # llama.cpp's rounding: half up on the offset codes
    assert np.all(np.abs(np.array(r.stored) - ref) <= abs(ext) * 2**-10)
    assert r.stored[int(np.argmax(np.abs(w)))] == pytest.approx(ext, rel=2**-10)
