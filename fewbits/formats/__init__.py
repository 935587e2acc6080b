"""Storage formats: what numbers are stored, how they are rounded and packed."""

from fewbits.formats.format import EXAMPLE_SPECS, Format, FormatError, parse_format

__all__ = ["Format", "FormatError", "parse_format", "EXAMPLE_SPECS"]
