"""What the GPU's free memory may buy, the rule shared by the engine's memory-for-speed choices (kept blocks,
gpu/kept_blocks.py; the teacher's resident integer codes, gpu/teacher.py): of the memory the device reports
(Device.memory_bytes), AUTO_SHARE times this engine's share of the GPU, less what the process holds already and
RESERVE_BYTES for what is allocated later (driver scratch, buffers made on first use, fragmentation)."""

from __future__ import annotations

AUTO_SHARE = 0.9
RESERVE_BYTES = 2 << 30


def free_bytes(device_bytes: int | None, held_bytes: int, share: float = 1.0) -> int:
    """Bytes an automatic choice may still spend: 0 where the device does not report its memory (None)."""
    if device_bytes is None:
        return 0
    return max(0, int(device_bytes * share * AUTO_SHARE) - held_bytes - RESERVE_BYTES)
