"""torch.save's zip records with or without their CRC-32 (``JitConfig.zip_crc32``): the synchronous save and the
async writer's thread write under the same setting."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch.utils.serialization import config as torch_serialization


@contextlib.contextmanager
def zip_crc32(enabled: bool) -> Iterator[None]:
    """torch.save computes each zip record's CRC-32 inside the block only when ``enabled`` (JitConfig.zip_crc32);
    torch's own setting is back after."""
    before = torch_serialization.save.compute_crc32
    torch_serialization.save.compute_crc32 = enabled
    try:
        yield
    finally:
        torch_serialization.save.compute_crc32 = before
