"""Every file and folder fewbits writes goes through here: whole or not at all, never over something fewbits
did not write, readable as the umask says, and (folders) with a manifest of checksums written last.

    write_dir(out, lambda tmp: ..., overwrite=False, kind="quantized-model")   # a folder: OUT/...
    write_file(out, lambda tmp: ..., overwrite=False)                          # one file
    write_text(out, text, overwrite=True)                                      # a report, a profile, a recipe
    check_output(out, overwrite)                                               # before hours of work

Why each rule (each was a lost or damaged output once):
- The output is built under a temporary name beside OUT (`.OUT.tmp<pid>-<host><rand>`) and renamed into
  place, so a killed run never leaves a partial OUT.  A folder's `fewbits-manifest.json` (size and sha256
  of every file) is written last: a folder without it, or whose files do not match it, is not whole.
- `--overwrite` replaces only an earlier fewbits output: a folder holding a manifest (or the metadata file
  of an output written before manifests existed), an empty folder, or for a one-file output a regular
  file; never a symlink, a device node or a folder of other files.  A folder is swapped with Linux'
  renameat2(RENAME_EXCHANGE), so a complete OUT exists at every instant; where that call is missing the
  old OUT is renamed to `.OUT.old<pid>-...` first, and a run that dies in that window has its old OUT put
  back by the next run.
- Temporaries of killed runs are removed by the next run into the same folder: only names this module
  makes, and only when the process that made them is dead (same host) or they are older than a day.
- OUT is checked before any work (`check_output`): a real probe entry with the longest temporary name is
  created and removed, so a read-only folder or a name the temporary name makes too long fails at once.
- mkdtemp/mkstemp and safetensors create private entries (0700/0600); every entry written here is set to
  what the umask allows, so a serving engine running as another user can read the output.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import stat
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from fewbits.manifest import (  # noqa: F401  (part of this module's interface)
    LEGACY_MARKERS,
    MANIFEST,
    IntegrityError,
    finish_dir,
    is_fewbits_output,
    read_manifest,
    verify_dir,
)

#: a temporary whose process still runs (or ran on another host) is removed only after this long
STALE_AFTER_S = 24 * 3600
#: temporaries of versions before this module (no process id in the name) are removed after this long
LEGACY_STALE_AFTER_S = 3600
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class OutputError(OSError):
    """OUT cannot be written: it is not fewbits' to replace, not writable, its name too long, the disk full."""


class OutputExistsError(OutputError, FileExistsError):
    """OUT exists and --overwrite was not given."""


# ---------------------------------------------------------------------- names of temporaries
def _host_tag() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:6]


def temp_name(name: str, role: str = "tmp") -> str:
    """`.NAME.tmp<pid>-<host><rand>`: whose it is (process, host) is in the name, for the cleanup."""
    return f".{name}.{role}{os.getpid()}-{_host_tag()}{secrets.token_hex(3)}"


def _longest_temp_name(name: str) -> str:
    return f".{name}.tmp{'9' * 10}-{'f' * 12}"


_TEMP_RE = re.compile(r"\.(?P<name>.+)\.(?P<role>tmp|old)(?P<pid>\d+)-(?P<host>[0-9a-f]{6})[0-9a-f]{6}")
#: before this module: mkdtemp(prefix=".NAME.tmp") and ".NAME.old<pid>"
_LEGACY_RE = re.compile(r"\.(?P<name>.+)\.(?:tmp[a-z0-9_]{8}|old(?P<pid>\d+))")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(path: Path) -> None:
    st = path.lstat()
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def clean_stale(parent: Path, name: str, legacy: re.Pattern[str] | None = None) -> list[Path]:
    """Remove temporaries of `parent/name` left by killed runs; put back an old OUT a killed swap left
    aside when OUT itself is missing.  `legacy` matches extra names of earlier versions (age rule only).
    Returns what was removed or restored."""
    done: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return done
    now, host = time.time(), _host_tag()
    for e in entries:
        m = _TEMP_RE.fullmatch(e.name)
        old_m = _LEGACY_RE.fullmatch(e.name)
        if m is not None and m["name"] == name:
            pid = int(m["pid"])
            if pid == os.getpid() and m["host"] == host:
                continue
            try:
                age = now - e.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            dead = m["host"] == host and not _pid_alive(pid)
            if not dead and age < STALE_AFTER_S:
                continue
            role = m["role"]
        elif ((old_m is not None and old_m["name"] == name)
              or (legacy is not None and legacy.fullmatch(e.name))):
            try:
                age = now - e.stat(follow_symlinks=False).st_mtime
            except OSError:
                continue
            pid = old_m["pid"] if old_m is not None else None
            dead = pid is not None and not _pid_alive(int(pid))
            if not dead and age < LEGACY_STALE_AFTER_S:
                continue
            role = "old" if pid is not None else "tmp"
        else:
            continue
        path = Path(parent) / e.name
        out = Path(parent) / name
        if role == "old" and not os.path.lexists(out) and e.is_dir(follow_symlinks=False) and is_fewbits_output(path):
            os.rename(path, out)  # the swap died between its two renames: the old OUT goes back
        else:
            _remove(path)
        done.append(path)
    return done


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---------------------------------------------------------------------- checks before any work
def check_output(out: str | os.PathLike[str], overwrite: bool = False, kind: str = "dir") -> Path:
    """Refuse OUT now, not after the work: '.', '..', a symlink, a device, a file where a folder goes, an
    existing output without `overwrite`, a folder fewbits did not write, a read-only parent, a name the
    temporary name makes too long.  Creates nothing that stays."""
    p = Path(out)
    if p.name in ("", ".", ".."):
        raise OutputError(f"output {str(out)!r} names no new {'folder' if kind == 'dir' else 'file'}; "
                          "give a name, e.g. ./smol-int4")
    try:
        holds_cwd = Path.cwd().resolve().is_relative_to(p.resolve())
    except (OSError, RuntimeError):  # no working folder, a symlink loop
        holds_cwd = False
    if holds_cwd:
        raise OutputError(f"output {str(out)!r} is the working folder or holds it; give another name")
    what = "folder" if kind == "dir" else "file"
    try:
        st: os.stat_result | None = p.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"output {p}: {e.strerror}" + (" (a file where a folder goes)" if e.errno == errno.ENOTDIR
                                                          else "")) from None
    if st is not None:
        if stat.S_ISLNK(st.st_mode):
            raise OutputError(f"output {p} is a symlink; fewbits writes a new {what} or replaces its own, "
                              "never a link (remove it or choose another name)")
        if stat.S_ISDIR(st.st_mode):
            if kind != "dir":
                raise OutputError(f"output {p} is a folder, not a file")
            empty = not any(p.iterdir())
            if not empty and not overwrite:
                raise OutputExistsError(f"{p} exists; pass --overwrite (overwrite=True) to replace it")
            if not empty and not is_fewbits_output(p):
                raise OutputError(f"{p} holds files fewbits did not write (no {MANIFEST}); --overwrite replaces "
                                  "only an earlier fewbits output: remove it yourself or choose another name")
        elif stat.S_ISREG(st.st_mode):
            if kind == "dir":
                raise OutputError(f"output {p} is a file; give a folder name")
            if not overwrite:
                raise OutputExistsError(f"{p} exists; pass --overwrite (overwrite=True) to replace it")
        else:
            raise OutputError(f"output {p} is a device or special file; fewbits writes only plain files and folders")
    _probe_parent(p)
    return p


def _probe_parent(p: Path) -> None:
    """Check name lengths, then create and remove a probe with the longest temporary name in the nearest
    existing folder above `p` (a real write: root ignores permission bits, not a read-only mount)."""
    anc = p.parent if str(p.parent) else Path(".")
    missing: list[str] = []  # folders to create, innermost first
    while not os.path.lexists(anc):
        missing.append(anc.name)
        if anc.parent == anc:
            break
        anc = anc.parent
    if not anc.is_dir():
        raise OutputError(f"output {p}: {anc} is not a folder")
    try:
        limit = os.pathconf(anc, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = _longest_temp_name(p.name)
    for n in [*missing, longest]:
        size = len(os.fsencode(n))
        if size > limit:
            extra = f" (fewbits writes under a temporary name {len(longest) - len(p.name)} bytes longer)" \
                if n == longest else ""
            raise OutputError(f"output {p}: the name {n[:32]!r}... needs {size} bytes, the file system allows "
                              f"{limit}{extra}; choose a shorter name")
    probe = anc / (_longest_temp_name(missing[-1]) if missing else longest)
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as e:
        raise OutputError(f"output {p}: cannot write in {anc} ({e.strerror})") from None


# ---------------------------------------------------------------------- writing
def _io_error(out: Path, e: BaseException) -> OutputError | None:
    """An I/O failure while writing (full disk, quota, read-only) as one line naming OUT."""
    if isinstance(e, OutputError):
        return None
    if isinstance(e, OSError):
        return OutputError(f"{out}: could not be written ({e.strerror or e})")
    if type(e).__name__ == "SafetensorError":  # safetensors wraps the OS error (e.g. no space left)
        return OutputError(f"{out}: could not be written ({e})")
    return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically with renameat2(RENAME_EXCHANGE); False where the system lacks it."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    fn = getattr(libc, "renameat2", None)
    if fn is None:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_in(tmp: Path, out: Path, overwrite: bool, keep_existing: Callable[[Path], bool] | None) -> None:
    if not os.path.lexists(out):
        try:
            os.rename(tmp, out)
            return
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    # OUT exists now: another run's, or the one we were asked to replace; look again right before the swap
    if keep_existing is not None and keep_existing(out):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    check_output(out, overwrite, "dir")
    if out.is_dir() and not any(out.iterdir()):
        os.replace(tmp, out)  # an empty folder
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old OUT
        return
    old = out.parent / temp_name(out.name, "old")
    os.rename(out, old)  # a run killed here has its old OUT put back by `clean_stale`
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def write_dir(out: str | os.PathLike[str], write: Callable[[Path], None], overwrite: bool = False,
              kind: str = "output", keep_existing: Callable[[Path], bool] | None = None,
              extra: Mapping[str, str | bytes] | None = None) -> Path:
    """Call `write(tmp)` on a fresh folder beside `out`, add the manifest, then swap it into place: a
    failure leaves no partial output and an earlier OUT as it was.  An existing non-empty `out` is replaced
    only with `overwrite` and only if it is a fewbits output.  `keep_existing(out)`, when given, is asked
    if an OUT that appeared meanwhile (another process) should be kept instead of this one.  `extra`:
    more files (name -> text or bytes) written beside `write`'s, inside the same swap and manifest."""
    out = Path(out)
    check_output(out, overwrite, "dir")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent, out.name)
    tmp = out.parent / temp_name(out.name)
    os.mkdir(tmp)
    try:
        write(tmp)
        for name, data in (extra or {}).items():
            if Path(name).name != name or name.startswith("."):
                raise OutputError(f"{name!r}: an extra file's name must be a plain file name")
            (tmp / name).write_bytes(data.encode() if isinstance(data, str) else data)
        finish_dir(tmp, kind)
        _swap_in(tmp, out, overwrite, keep_existing)
        _fsync_dir(out.parent)
    except BaseException as e:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        err = _io_error(out, e)
        if err is not None:
            raise err from e
        raise
    return out


def write_file(out: str | os.PathLike[str], write: Callable[[Path], None], overwrite: bool = False) -> Path:
    """Call `write(tmp)` on a fresh path beside `out`, then rename it to `out`: a failure leaves no partial
    file.  An existing `out` is replaced only with `overwrite`, and only if it is a regular file."""
    out = Path(out)
    check_output(out, overwrite, "file")
    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(out.parent, out.name)
    tmp = out.parent / temp_name(out.name)
    os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666))  # umask applies; writers keep the mode
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with tmp.open("rb") as f:
            os.fsync(f.fileno())
        check_output(out, overwrite, "file")  # nothing put a link or a folder there meanwhile
        os.replace(tmp, out)
        _fsync_dir(out.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        err = _io_error(out, e)
        if err is not None:
            raise err from e
        raise
    return out


def write_bytes(out: str | os.PathLike[str], data: bytes, overwrite: bool = True) -> Path:
    """`data` as the whole of file `out` (atomically); by default an existing regular file is replaced."""
    return write_file(out, lambda tmp: tmp.write_bytes(data), overwrite)


def write_text(out: str | os.PathLike[str], text: str, overwrite: bool = True) -> Path:
    """`text` (UTF-8) as the whole of file `out` (atomically); by default an existing regular file is replaced."""
    return write_bytes(out, text.encode(), overwrite)


__all__ = ["MANIFEST", "OutputError", "OutputExistsError", "IntegrityError", "check_output", "write_dir",
           "write_file", "write_text", "write_bytes", "verify_dir", "read_manifest", "is_fewbits_output",
           "clean_stale", "temp_name"]
