"""The converted-model cache checks itself (issue 20, defect 3): a truncated entry is damaged on every use
(sizes against the manifest), a bit flip is found by the full check `fewbits models` runs (sha256), and
neither is listed as converted."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from fewbits.files import write_dir
from fewbits.models import packaged


@pytest.fixture
def entry(tmp_path, monkeypatch):
    monkeypatch.setenv("FEWBITS_CACHE", str(tmp_path))
    e = packaged.PackagedModel(name="tiny-cache", kind="causal-lm", package="none", dist="none",
                               description="a test entry", gguf="tiny.gguf")
    monkeypatch.setitem(packaged.PACKAGED, e.name, e)
    monkeypatch.setattr(packaged, "source_files", lambda entry: [tmp_path / "tiny.gguf"])
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")

    def write(tmp):
        import torch
        from safetensors.torch import save_file

        save_file({"w": torch.arange(64, dtype=torch.float32)}, str(tmp / "model.safetensors"))
        (tmp / packaged.SOURCE_FILE).write_text(json.dumps({"conversion_version": packaged.CONVERSION_VERSION}))
    write_dir(packaged.cache_root() / e.name, write, kind="packaged-model")
    return packaged.cache_root() / e.name


def test_a_bit_flip_is_found_by_the_full_check(entry):
    assert packaged.cache_state("tiny-cache", full=True) == ("converted", "")
    wf = entry / "model.safetensors"
    data = bytearray(wf.read_bytes())
    data[-7] ^= 0x04
    wf.write_bytes(bytes(data))
    assert packaged.is_converted("tiny-cache")  # every use checks sizes only (a 540 MB hash per load is not free)
    state, why = packaged.cache_state("tiny-cache", full=True)
    assert state == "damaged" and "sha256" in why


def test_a_truncated_entry_is_damaged_and_fewbits_models_says_so(entry, monkeypatch):
    from fewbits.cli import main
    from fewbits.cli import models as cli_models

    wf = entry / "model.safetensors"
    wf.write_bytes(wf.read_bytes()[:100])
    assert not packaged.is_converted("tiny-cache")
    monkeypatch.setattr(packaged, "PACKAGED", {"tiny-cache": packaged.PACKAGED["tiny-cache"]})
    monkeypatch.setattr(packaged, "is_installed", lambda e: True)
    monkeypatch.setattr(packaged, "source_bytes", lambda e: 4)
    monkeypatch.setattr(cli_models, "_gguf_params", lambda p: 0)
    r = CliRunner().invoke(main, ["models"])
    assert r.exit_code == 0, r.output
    assert "damaged, converted again on next use" in r.output and "truncated" in r.output
