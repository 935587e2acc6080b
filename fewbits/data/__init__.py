"""Packaged text for calibration and evaluation, user text files, and token windows.

See `fewbits.data.texts` (the sources and the split) and `fewbits.data.tokens` (windows).
"""
