"""Seeds derived from names: the one rule every capture, sweep and test uses to draw reproducible inputs."""

from __future__ import annotations

import zlib


def derive_seed(*parts: object) -> int:
    """The CRC-32 of the parts joined by '/': ``derive_seed(0, "amla-table3", "normal:1", 7)``."""
    return zlib.crc32("/".join(map(str, parts)).encode())
