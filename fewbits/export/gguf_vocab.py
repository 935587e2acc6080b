"""The vocabulary of a GGUF file: built from a Hugging Face byte-level BPE tokenizer (llama.cpp's "gpt2"
model), or copied field by field from another GGUF file (a packaged model's own, e.g. Gemma-3's
SentencePiece vocabulary with its scores, which a Hugging Face tokenizer.json does not carry)."""

from __future__ import annotations

import json
import os
from typing import Any

from fewbits.export.common import ExportError

#: (key, value, value type name, array element type name or None): what GGUFWriter.add_key_value takes
Field = tuple[str, Any, str, "str | None"]


def is_byte_level_bpe(tokenizer: Any) -> bool:
    """True for a tokenizer `bpe_fields` can write (a BPE model without SentencePiece's byte fallback)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = json.loads(backend.to_str()).get("model", {}) if backend is not None else {}
    return model.get("type") == "BPE" and not model.get("byte_fallback")


def bpe_fields(tokenizer: Any, vocab_size: int, pre: str | None) -> list[Field]:
    """llama.cpp's "gpt2" BPE vocabulary from a Hugging Face fast tokenizer: tokens, token types, merges,
    special ids; the pre-tokenizer name `pre` (else "default")."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = json.loads(backend.to_str()) if backend is not None else {}
    model = state.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        kind = "SentencePiece-style BPE (byte fallback)" if model.get("byte_fallback") else \
            model.get("type", type(tokenizer).__name__)
        raise ExportError(f"GGUF export builds byte-level BPE vocabularies (llama.cpp's gpt2 model); this "
                          f"tokenizer is {kind}: pass the vocabulary of a GGUF file instead (vocab_from=)")
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    special = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    added = set(getattr(tokenizer, "added_tokens_encoder", {}))
    tokens, types = [], []
    for i in range(vocab_size):
        t = vocab.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(5)  # unused
        else:
            tokens.append(t)
            types.append(3 if t in special else 4 if t in added else 1)  # control, user-defined, normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    fields: list[Field] = [
        ("tokenizer.ggml.model", "gpt2", "STRING", None), ("tokenizer.ggml.pre", pre or "default", "STRING", None),
        ("tokenizer.ggml.tokens", tokens, "ARRAY", "STRING"), ("tokenizer.ggml.token_type", types, "ARRAY", "INT32"),
        ("tokenizer.ggml.merges", merges, "ARRAY", "STRING")]
    for key, tid in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                     ("unknown", tokenizer.unk_token_id), ("padding", tokenizer.pad_token_id)):
        if tid is not None:
            fields.append((f"tokenizer.ggml.{key}_token_id", int(tid), "UINT32", None))
    fields.append(("tokenizer.ggml.add_bos_token", bool(getattr(tokenizer, "add_bos_token", False)), "BOOL", None))
    if getattr(tokenizer, "chat_template", None):
        fields.append(("tokenizer.chat_template", tokenizer.chat_template, "STRING", None))
    return fields


def gguf_fields(path: str | os.PathLike[str], prefix: str = "tokenizer.") -> list[Field]:
    """Every metadata field of GGUF file `path` whose key starts with `prefix`, as written there."""
    from gguf import GGUFReader, GGUFValueType

    out: list[Field] = []
    for key, f in GGUFReader(path).fields.items():
        if not key.startswith(prefix):
            continue
        vtype = f.types[0]
        sub = f.types[1].name if vtype == GGUFValueType.ARRAY and len(f.types) > 1 else None
        value = f.contents()
        out.append((key, value, vtype.name, sub))
    if not out:
        raise ExportError(f"{path}: no {prefix}* fields to copy")
    return out


def write_fields(writer: Any, fields: list[Field]) -> None:
    """Add `fields` to a gguf.GGUFWriter."""
    from gguf import GGUFValueType

    for key, value, vtype, sub in fields:
        if vtype == "ARRAY" and len(value) == 0:  # GGUF has no empty arrays (a BPE without merges)
            continue
        writer.add_key_value(key, value, GGUFValueType[vtype], GGUFValueType[sub] if sub else None)
