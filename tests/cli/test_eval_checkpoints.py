"""`fewbits eval` on a GGUF file: the same scores as on the fewbits directory holding the same numbers."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from fewbits import api
from fewbits.cli import main as cli

gguf = pytest.importorskip("gguf")


def test_eval_scores_a_gguf_file_like_the_fewbits_directory(tmp_path):
    from fewbits.export.gguf import export_gguf
    from tests.export.test_gguf import _bpe_tokenizer
    from tests.models.test_external import _tiny

    ref = _tiny()
    with torch.no_grad():  # dense matrices on F16's grid, so the file (F16) and the directory hold the same numbers
        for p in ref.parameters():
            if p.dim() == 2:
                p.copy_(p.half().float())
    tok = _bpe_tokenizer()
    ref.save_pretrained(tmp_path / "ref")
    tok.save_pretrained(tmp_path / "ref")
    m = _tiny()
    m.load_state_dict(ref.state_dict())
    rep = api.quantize(m, "q4_k", progress=False, chooser="cached")
    export_gguf(m, tmp_path / "m.gguf", tok)
    api.save_quantized_model(m, api.Recipe.from_format("q4_k"), tmp_path / "fb", tok, report=rep,
                             source=str(tmp_path / "ref"))
    (tmp_path / "t.txt").write_text("the thin cat in the tent ate the thin tent " * 40)
    rows = {}
    for name, path in (("gguf", tmp_path / "m.gguf"), ("fewbits", tmp_path / "fb")):
        res = CliRunner().invoke(cli, ["eval", str(path), "--ref", str(tmp_path / "ref"), "--text",
                                       str(tmp_path / "t.txt"), "--seq-len", "32", "--windows", "2", "--quiet",
                                       "--json", str(tmp_path / f"{name}.json")])
        assert res.exit_code == 0, res.output
        rows[name] = json.loads((tmp_path / f"{name}.json").read_text())["rows"][0]
    assert rows["gguf"]["format"] == "Q4_K x14" and rows["fewbits"]["format"] == "q4_k"
    assert rows["gguf"]["bits_per_weight"] == rows["fewbits"]["bits_per_weight"] == 4.5
    kl_g, kl_f = rows["gguf"]["overall"]["kl_mean"], rows["fewbits"]["overall"]["kl_mean"]
    assert kl_f > 0 and kl_g == pytest.approx(kl_f, rel=1e-4, abs=1e-7)


def test_eval_of_a_foreign_checkpoint_needs_ref(tmp_path):
    from fewbits.export.gguf import export_gguf
    from tests.export.test_gguf import _bpe_tokenizer
    from tests.models.test_external import _tiny

    m = _tiny()
    api.quantize(m, "q8_0", progress=False, chooser="cached")
    export_gguf(m, tmp_path / "m.gguf", _bpe_tokenizer())
    res = CliRunner().invoke(cli, ["eval", str(tmp_path / "m.gguf")])
    assert res.exit_code != 0 and "pass --ref" in res.output
    res = CliRunner().invoke(cli, ["eval", str(tmp_path / "missing.gguf"), "--ref", "x"])
    assert res.exit_code != 0 and "no such file" in res.output
