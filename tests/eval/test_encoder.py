"""Encoder quality on the packaged all-MiniLM-L6-v2: sentence-embedding cosine to the fp32 model."""

from __future__ import annotations

import copy

import pytest
import torch

from fewbits import api
from fewbits.eval.encoder import sentence_embeddings, split_sentences
from fewbits.eval.run import compare_encoder, is_causal_lm


def test_split_sentences():
    text = "One two three four five. Six seven.\n\nEight nine ten eleven twelve thirteen! " + "word " * 80 + "."
    assert split_sentences(text, 5) == ["One two three four five.", "Eight nine ten eleven twelve thirteen!"]
    with pytest.raises(ValueError, match="no sentence of 5..60 words"):
        split_sentences("too short.")


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    from fewbits.data.texts import load_texts
    from fewbits.models.loading import load_model

    model, tok = load_model(minilm_dir, dtype="float32")
    return model, tok, load_texts("eval", max_chars=20_000)


@pytest.mark.slow
def test_minilm_cosine_orders_formats_and_reload_is_exact(minilm, tmp_path):
    ref, tok, texts = minilm
    assert not is_causal_lm(ref)
    same = compare_encoder(ref, ref, tok, texts, per_category=8)
    assert same["overall"]["cos_min"] > 0.99999 and same["overall"]["sentences"] == 24
    cos = {}
    for spec in ("int8", "int4-g32"):
        m = copy.deepcopy(ref)
        rep = api.quantize(m, spec, progress=False)
        assert len(rep.quantized_layers) == 37  # 6 blocks x 6 linears + the pooler
        res = compare_encoder(m, ref, tok, texts, per_category=8)
        cos[spec] = res["overall"]["cos_mean"]
        assert set(res["categories"]) == {"verse", "prose", "code"}
        if spec == "int8":  # a BERT without tied weights round-trips exactly too
            out = api.save_quantized_model(m, api.Recipe.from_format(spec), tmp_path / "q", tok)
            again, tok2, _ = api.load_quantized_model(out)
            s = split_sentences(texts["prose"], 4)
            assert torch.equal(sentence_embeddings(again, tok2, s), sentence_embeddings(m, tok, s))
    assert cos["int8"] > 0.999 and 0.9 < cos["int4-g32"] < cos["int8"], cos
