"""The one atomic writer lives in `fewbits.files` (every layer writes through it); kept importable here."""

from fewbits.files import write_dir, write_file

__all__ = ["write_dir", "write_file"]
