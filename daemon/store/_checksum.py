"""The CRC-32 that frames journal entries and wake-log records.

ISA-L's where python-isal is installed (the `fast` extra), else zlib's. Both compute
zlib's CRC-32, the same polynomial and the same numbers, so a file written with one
verifies with the other. ISA-L's folds with carry-less multiplication: 10 GB/s on
this project's bench machine against zlib 1.2's 2.4, and faster at every size down to
a 40-byte note. A worker that floods its output otherwise spends a third of the
daemon's CPU on this sum (bench/README.md, journal capture).
"""

from __future__ import annotations

try:
    from isal.isal_zlib import crc32
except ImportError:  # the `fast` extra is not installed
    from zlib import crc32

__all__ = ["crc32"]
