"""The one writer (fewbits.files): what --overwrite may replace, the swap, temporaries of killed runs, OUT
checked before any work, modes from the umask, a full disk as one line.  Each case was a lost or private
output once (issue 20, defects 2, 3, 10, 11)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from fewbits import files as F


def _write(text: str = "new"):
    def write(tmp: Path) -> None:
        (tmp / "a.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.bin").write_bytes(b"\0" * 10)
    return write


def _tree(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_manifest_lists_every_file_with_its_sha256(tmp_path):
    import hashlib

    out = F.write_dir(tmp_path / "o", _write())
    man = F.verify_dir(out, required=True)
    assert sorted(man["files"]) == ["a.txt", "sub/b.bin"]  # the manifest itself is not listed
    assert man["files"]["a.txt"] == {"bytes": 3, "sha256": hashlib.sha256(b"new").hexdigest()}
    assert os.listdir(tmp_path) == ["o"]
    (out / "sub" / "b.bin").write_bytes(b"\0" * 9 + b"\1")  # same size, one bit
    F.verify_dir(out, full=False)
    with pytest.raises(F.IntegrityError, match="sha256"):
        F.verify_dir(out)


@pytest.mark.parametrize("what", ["foreign folder", "file", "symlink", "device"])
def test_overwrite_never_replaces_what_fewbits_did_not_write(tmp_path, what):
    out = tmp_path / "OUT"
    if what == "foreign folder":
        out.mkdir()
        (out / "thesis.tex").write_text("years of work")
    elif what == "file":
        out.write_text("mine")
    elif what == "symlink":
        F.write_dir(tmp_path / "real", _write("old"))  # even a link to a fewbits output stays a link
        out.symlink_to(tmp_path / "real")
    else:
        out = Path("/dev/null")
    before = sorted(os.listdir(out.parent)) if what != "device" else None
    with pytest.raises(F.OutputError, match="fewbits did not write|is a file|symlink|device") as e:
        F.write_dir(out, _write(), overwrite=True)
    assert "\n" not in str(e.value)
    if what != "device":
        assert sorted(os.listdir(tmp_path)) == before  # nothing removed, nothing left behind
    if what == "foreign folder":
        assert (out / "thesis.tex").read_text() == "years of work"
    if what == "symlink":
        assert out.is_symlink() and (tmp_path / "real" / "a.txt").read_text() == "old"


def test_overwrite_replaces_an_earlier_output_by_exchange(tmp_path, monkeypatch):
    out = F.write_dir(tmp_path / "o", _write("old"))
    F.write_dir(out, _write("new"), overwrite=True)
    assert (out / "a.txt").read_text() == "new" and os.listdir(tmp_path) == ["o"]
    # a failing writer leaves the old output whole
    with pytest.raises(RuntimeError):
        F.write_dir(out, lambda tmp: (_ for _ in ()).throw(RuntimeError("boom")), overwrite=True)
    assert (out / "a.txt").read_text() == "new" and os.listdir(tmp_path) == ["o"]
    F.verify_dir(out, required=True)


def test_exchange_is_atomic_on_linux(tmp_path):
    if not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux'")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    (a / "x").write_text("a")
    (b / "x").write_text("b")
    assert F._exchange(a, b)
    assert (a / "x").read_text() == "b" and (b / "x").read_text() == "a"


def test_a_swap_killed_between_its_renames_gets_its_old_output_back(tmp_path):
    """The fallback (no renameat2): the old OUT is renamed aside first; a run killed then leaves no OUT,
    and the next run puts the old one back before anything else."""
    out = F.write_dir(tmp_path / "o", _write("old"))
    dead = _dead_pid()
    aside = tmp_path / f".o.old{dead}-{F._host_tag()}abc123"
    os.rename(out, aside)
    F.clean_stale(tmp_path, "o")
    assert _tree(out) == _tree(out) and (out / "a.txt").read_text() == "old"
    assert os.listdir(tmp_path) == ["o"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_temporaries_of_dead_runs_are_removed_by_the_next_run(tmp_path):
    host = F._host_tag()
    dead = _dead_pid()
    stale = [f".o.tmp{dead}-{host}a1b2c3", f".o.old{dead}-{host}a1b2c3", ".o.tmpab_cd123", f".o.old{dead}"]
    live = [f".o.tmp{os.getppid()}-{host}a1b2c3", f".o.tmp{dead}-{'0' * 6}a1b2c3"]  # running; another host
    foreign = [".o.tmp-notes", ".other.tmp1-abcdefabcdef", "o.tmp123-abcdefabcdef"]
    for n in stale + live + foreign:
        (tmp_path / n).mkdir()
        (tmp_path / n / "big").write_bytes(b"x" * 100)
    old = time.time() - 2 * F.LEGACY_STALE_AFTER_S
    os.utime(tmp_path / ".o.tmpab_cd123", (old, old))  # an earlier version's temporary (no pid): by age
    F.write_dir(tmp_path / "o", _write())
    assert sorted(os.listdir(tmp_path)) == sorted(["o", *live, *foreign])


def test_output_checked_before_any_work_in_well_under_a_second(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    long = "x" * 240  # a legal name that the temporary name makes too long
    cases = {".": "names no new folder", "..": "names no new folder", long: "allows 255",
             str(tmp_path / "f" / "o"): "a file where a folder goes"}
    (tmp_path / "f").write_text("a file where a folder goes")
    try:  # a read-only mount refuses even root; /sys is one in most containers
        os.mkdir("/sys/fewbits-probe")
        os.rmdir("/sys/fewbits-probe")
    except OSError:
        cases["/sys/fewbits-out"] = "cannot write"
    for out, msg in cases.items():
        t0 = time.perf_counter()
        with pytest.raises(F.OutputError, match=msg):
            F.check_output(out, overwrite=True)
        assert time.perf_counter() - t0 < 0.5
    assert sorted(os.listdir(tmp_path)) == ["f"]  # the probe leaves nothing


def test_quantize_cli_refuses_a_bad_out_before_loading_the_model(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from fewbits.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "data.csv").write_text("1,2")
    for out, msg in ((".", "names no new folder"), ("x" * 240, "allows 255"), ("mine", "fewbits did not write")):
        t0 = time.perf_counter()
        r = CliRunner().invoke(main, ["quantize", "no-such-model-anywhere", "--format", "int4-g64", "-o", out,
                                      "--overwrite"])
        assert r.exit_code == 1 and msg in r.output and "Traceback" not in r.output, r.output
        assert time.perf_counter() - t0 < 1.0
    assert (tmp_path / "mine" / "data.csv").read_text() == "1,2"


def test_modes_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        def write(tmp: Path) -> None:
            import torch
            from safetensors.torch import save_file

            save_file({"w": torch.zeros(2)}, str(tmp / "model.safetensors"))  # safetensors makes it 0600
        out = F.write_dir(tmp_path / "o", write)
        f = F.write_text(tmp_path / "r.json", "{}")
    finally:
        os.umask(old)
    assert oct(out.stat().st_mode & 0o777) == "0o755"
    assert {oct(p.stat().st_mode & 0o777) for p in out.iterdir()} == {"0o644"}
    assert oct(f.stat().st_mode & 0o777) == "0o644"


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """RLIMIT_FSIZE makes the write fail as a full disk does (EFBIG instead of ENOSPC) inside safetensors."""
    script = textwrap.dedent(f"""
        import resource, signal, sys, torch
        from safetensors.torch import save_file
        from fewbits import files as F
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            F.write_dir({str(tmp_path / 'o')!r},
                        lambda tmp: save_file({{"w": torch.zeros(1 << 20)}}, str(tmp / "m.safetensors")))
        except F.OutputError as e:
            print("ERROR", e)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ERROR")]
    assert len(lines) == 1 and "could not be written" in lines[0] and "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []
