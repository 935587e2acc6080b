"""Packaged texts: three categories, calibration and evaluation disjoint; user files; token windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fewbits.data.texts import (
    CATEGORIES,
    TextError,
    code_files,
    load_texts,
    plain_play,
    prose_topics,
    texts_from_files,
    token_windows,
    wants_bos,
)


@pytest.fixture(scope="module")
def both() -> tuple[dict[str, str], dict[str, str]]:
    pytest.importorskip("pydoc_data.topics")
    return load_texts("calib"), load_texts("eval")


def test_three_categories_non_empty(both) -> None:
    calib, ev = both
    assert tuple(calib) == tuple(ev) == CATEGORIES == ("verse", "prose", "code")
    for split in both:
        for cat, text in split.items():
            assert len(text) > 50_000, cat
    assert calib["verse"].startswith("Macbeth") and ev["verse"].startswith("Hamlet")
    assert "**" not in ev["verse"] and "\\[" not in ev["verse"] and "  \n" not in ev["verse"]


def test_sources_disjoint() -> None:
    assert set(prose_topics("calib")).isdisjoint(prose_topics("eval"))
    assert len(prose_topics("calib")) >= 30 and len(prose_topics("eval")) >= 30
    assert set(code_files("calib")).isdisjoint(code_files("eval"))
    assert len(code_files("calib")) >= 50 and len(code_files("eval")) >= 50


def test_passages_disjoint(both) -> None:
    """No 300-character passage of an evaluation text occurs anywhere in the calibration texts (even
    near-copied stdlib modules such as aifc.py / sunau.py, which share whole paragraphs)."""
    calib, ev = both
    pool = "\n".join(calib.values())
    for cat, text in ev.items():
        step = max(1, len(text) // 500)
        hits = [i for i in range(0, len(text) - 300, step) if text[i:i + 300] in pool]
        assert hits == [], f"{cat}: eval passages at {hits[:3]} also in calibration text"


def test_deterministic_and_truncated() -> None:
    a = load_texts("eval", categories=["prose", "code"], max_chars=1000)
    assert list(a) == ["prose", "code"] and all(len(t) == 1000 for t in a.values())
    assert a == load_texts("eval", categories=["prose", "code"], max_chars=1000)
    with pytest.raises(TextError, match="unknown text split 'test'"):
        load_texts("test")
    with pytest.raises(TextError, match="unknown text category 'poetry'"):
        load_texts("eval", categories=["poetry"])


def test_plain_play() -> None:
    md = "# Play\n\n## ACT I\n\n_Enter KING_\n\n**KING**  \nNow is the winter,\\--  \n_\\[Aside]_ of our\n"
    assert plain_play(md) == "Play\n\nACT I\n\nEnter KING\n\nKING\nNow is the winter,--\n[Aside] of our\n"


def test_user_files(tmp_path: Path) -> None:
    a, b = tmp_path / "notes.txt", tmp_path / "mail.txt"
    a.write_text("first file\n")
    b.write_text("second file\n")
    assert texts_from_files([a, b]) == {"notes": "first file\n", "mail": "second file\n"}
    assert list(texts_from_files([a, b], names=["x", "y"])) == ["x", "y"]
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n\n")
    with pytest.raises(TextError, match=r"empty\.txt is empty"):
        texts_from_files([a, empty])
    with pytest.raises(TextError, match=r"missing\.txt does not exist"):
        texts_from_files([tmp_path / "missing.txt"])
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(TextError, match=r"bin\.txt is not UTF-8"):
        texts_from_files([bad])
    with pytest.raises(TextError, match="duplicate"):
        texts_from_files([a, b], names=["x", "x"])
    with pytest.raises(TextError, match="one name per file"):
        texts_from_files([a, b], names=["x"])


# ----------------------------------------------------------------------------------------------- windows
def test_windows_with_and_without_bos(tiny_tokenizer) -> None:
    text = "abcdefghij" * 10  # 100 byte tokens
    ids = [b + 4 for b in text.encode()]
    w = token_windows(tiny_tokenizer, text, seq_len=16)  # tiny tokenizer adds BOS -> 15 text tokens each
    assert wants_bos(tiny_tokenizer) and w.dtype == torch.long and w.shape == (6, 16)
    assert (w[:, 0] == 1).all() and w[:, 1:].flatten().tolist() == ids[:90]
    w = token_windows(tiny_tokenizer, text, seq_len=16, add_bos=False)
    assert w.shape == (6, 16) and w.flatten().tolist() == ids[:96]
    assert token_windows(tiny_tokenizer, text, seq_len=16, n_windows=2).shape == (2, 16)
    assert token_windows(tiny_tokenizer, text, seq_len=16, n_windows=50).shape == (6, 16)  # at most
    with pytest.raises(ValueError, match="fewer than one window"):
        token_windows(tiny_tokenizer, "short", seq_len=16)
    with pytest.raises(ValueError, match="seq_len must be at least 2"):
        token_windows(tiny_tokenizer, text, seq_len=1)


def test_windows_real_tokenizers(smollm2_dir: Path, gemma3_dir: Path) -> None:
    """SmolLM2 gets no BOS, Gemma one per window; a few windows equal the prefix of all windows."""
    from transformers import AutoTokenizer

    text = load_texts("eval", ["verse"])["verse"]
    smol_tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert not wants_bos(smol_tok)
    full = token_windows(smol_tok, text, 128)
    few = token_windows(smol_tok, text, 128, n_windows=3)
    assert full.shape[0] > 100 and torch.equal(few, full[:3])
    assert torch.equal(full.flatten()[:1000], torch.tensor(smol_tok.encode(text, add_special_tokens=False)[:1000]))
    gemma_tok = AutoTokenizer.from_pretrained(str(gemma3_dir))
    g = token_windows(gemma_tok, text, 64, n_windows=4)
    assert wants_bos(gemma_tok) and g.shape == (4, 64) and (g[:, 0] == gemma_tok.bos_token_id).all()
    assert (g[:, 1:] != gemma_tok.bos_token_id).all()
    sample = load_texts("eval", max_chars=5000)  # the GGUF-built tokenizers round-trip every kind of text
    for tok in (smol_tok, gemma_tok):
        for cat, t in sample.items():
            assert tok.decode(tok.encode(t, add_special_tokens=False)) == t, (type(tok).__name__, cat)
