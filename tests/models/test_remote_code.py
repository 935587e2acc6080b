"""No code from a model folder is ever run: an `auto_map` (transformers' hook for a folder's own Python) is
refused by name before transformers reads the folder, with stdin closed (no prompt), and the folder's
Python file is never imported.  Every transformers loader call passes trust_remote_code=False."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fewbits.models.loading import ModelLoadError, load_model, refuse_remote_code

ROOT = Path(__file__).resolve().parents[2]
#: a folder's Python that leaves a mark if it is ever imported
EVIL = "import pathlib\npathlib.Path(__file__).with_name('RAN').write_text('ran')\n"


def _tiny_folder(tmp_path: Path, tiny_llama) -> Path:
    out = tmp_path / "remote"
    tiny_llama.save_pretrained(out)
    (out / "evil.py").write_text(EVIL)
    return out


def _add_auto_map(folder: Path, file: str) -> None:
    p = folder / file
    cfg = json.loads(p.read_text()) if p.is_file() else {}
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                       "AutoTokenizer": ["evil.EvilTokenizer", None]}
    p.write_text(json.dumps(cfg))


@pytest.mark.parametrize("file", ["config.json", "tokenizer_config.json"])
def test_auto_map_refused_before_transformers(tmp_path: Path, tiny_llama, file: str) -> None:
    folder = _tiny_folder(tmp_path, tiny_llama)
    _add_auto_map(folder, file)
    with pytest.raises(ModelLoadError, match=rf"{file}.*auto_map.*never runs"):
        load_model(folder)
    with pytest.raises(ModelLoadError, match="auto_map"):
        refuse_remote_code(folder)
    assert not (folder / "RAN").exists()


def test_cli_refuses_with_stdin_closed(tmp_path: Path, tiny_llama) -> None:
    """`python -m fewbits quantize DIR` with no terminal: one line naming the file, exit 1 at once, no prompt."""
    folder = _tiny_folder(tmp_path, tiny_llama)
    _add_auto_map(folder, "config.json")
    r = subprocess.run([sys.executable, "-m", "fewbits", "quantize", str(folder), "--format", "int8",
                        "-o", str(tmp_path / "out")], stdin=subprocess.DEVNULL, capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode != 0
    assert "auto_map" in r.stderr and "Traceback" not in r.stderr and "[y/N]" not in r.stdout + r.stderr
    assert not (folder / "RAN").exists() and not (tmp_path / "out").exists()


def test_saved_model_with_auto_map_refused(tmp_path: Path, tiny_llama) -> None:
    from fewbits import api

    api.quantize(tiny_llama, "int8", progress=False)
    out = api.save_quantized_model(tiny_llama, api.Recipe.from_format("int8"), tmp_path / "q")
    (out / "evil.py").write_text(EVIL)
    _add_auto_map(out, "config.json")
    from fewbits.manifest import MANIFEST, finish_dir

    (out / MANIFEST).unlink()
    finish_dir(out, "fewbits")  # a crafted folder with a matching manifest: the auto_map itself is refused
    with pytest.raises(ModelLoadError, match="auto_map"):
        api.load_quantized_model(out)
    assert not (out / "RAN").exists()


def _loader_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls of from_pretrained / AutoConfig.for_model-like loaders that read a folder or the hub."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "from_pretrained":
            out.append(node)
    return out


def test_every_from_pretrained_passes_trust_remote_code_false() -> None:
    """A source scan: every `.from_pretrained(` call in fewbits/ and benchmarks/ says trust_remote_code=False."""
    missing = []
    for path in sorted([*(ROOT / "fewbits").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for call in _loader_calls(ast.parse(path.read_text())):
            kw = {k.arg: k.value for k in call.keywords}
            v = kw.get("trust_remote_code")
            if not (isinstance(v, ast.Constant) and v.value is False):
                missing.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert not missing, f"from_pretrained without trust_remote_code=False: {missing}"
    assert len([1 for p in (ROOT / "fewbits").rglob("*.py") for _ in _loader_calls(ast.parse(p.read_text()))]) >= 6
