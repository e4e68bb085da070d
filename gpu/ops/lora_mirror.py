"""f16 mirrors of the LoRA parameters for the integer GEMM's LoRA epilogue (gpu/kernels/lora_mirror.wgsl).

That epilogue multiplies t16 [T, LR] by L16 on the f16 tensor cores (gpu/ops/matmul_i8.py LoraTerm): B as
L^T [d_out, LR] in the forward, A R [LR, d_in] (A rotated like the weight codes) in the input gradient. Packed per
GEMM (gpu/ops/lora.py lora_term) that costs a lora_pack dispatch each, and for A a hadamard_rows one: ~27 a block
every step, for values that change only at an optimizer step. The mirrors hold every adapter's B16 (and A R16)
in one buffer, refreshed at the start of each forward in one dispatch per rotation block, bitwise the values the
packing wrote; t16 comes with t and dt from their lora_reduce pass (gpu/ops/lora_matmul.py HalfCopy). For ranks
that are multiples of 16 (LR = r: the mirrors copy whole matrices)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gpu.device import BufferView, Device, DeviceError
from gpu.ops.common import grid, pack
from gpu.ops.quantize_i8 import tint
from gpu.registry import pipeline
from model.lora_layout import LoraSlot

# on: the integer GEMMs' LoRA operands from the mirrors and the f16 copies of t / dt; off: lora_term packs them per
# GEMM (bench/train_step.py --ab lora-mirrors-off)
MIRRORS = True
MAX_ROW = 4 * 256 * 16  # values of one lora_mirror.wgsl table row at most (WG invocations x PER groups of four)
PLAIN_ROT = 128  # the kernel variant that copies unrotated rows where no row rotates


def mirrors_cover(r: int) -> bool:
    """Whether MIRRORS is on and the rank needs no padding to the f16 MMA's 16."""
    return MIRRORS and r > 0 and r % 16 == 0


class LoraMirrors:
    """Every adapter's B16 ([d_out, r] f16) and, where `rotation` is given (a function of d_in: its rotation block,
    0 for none), its A R16 ([r, d_in] f16, A rotated like the weight codes of that width), each at an offset the
    device can bind, in one buffer; `refresh` rewrites them from the f32 parameters."""

    def __init__(
        self,
        dev: Device,
        slots: Mapping[tuple[int, str], LoraSlot],
        r: int,
        rotation: Callable[[int], int] | None = None,
    ) -> None:
        if r % 16:
            raise DeviceError(f"LoRA mirrors: rank {r} is not a multiple of 16")
        align = max(dev.offset_alignment // 2, 4)  # f16 elements
        tables: dict[int, list[tuple[int, int, int, int]]] = {}  # rotation block -> rows (src, dst, units, col + 1)
        self._b: dict[tuple[int, str], tuple[int, int]] = {}
        self._a: dict[tuple[int, str], tuple[int, int]] = {}
        off = 0

        def place(src: int, n: int, row_len: int, rot: int) -> int:
            """Rows of row_len values from parameter src, copied (rot > 0: rotated) to the mirror at `off`."""
            if src % 4 or row_len % 4 or (rot and row_len % rot):
                raise DeviceError(f"LoRA mirrors: rows of {row_len} at parameter {src} do not fit the mirror kernel")
            for row in range(0, n, row_len):
                for c in range(0, row_len, MAX_ROW):
                    units = min(MAX_ROW, row_len - c) // 4
                    entry = ((src + row + c) // 4, (off + row + c) // 4, units, c + 1 if rot else 0)
                    tables.setdefault(rot, []).append(entry)
            return off + -(-n // align) * align

        for key, s in slots.items():
            n = s.d_out * r
            self._b[key] = (off, n)
            off = place(s.b_off, n, n, 0)
            if rotation is not None:
                n = r * s.d_in
                self._a[key] = (off, n)
                off = place(s.a_off, n, s.d_in, rotation(s.d_in))
        plain = tables.pop(0, [])  # unrotated rows ride with the first rotation's (their rows never rotate)
        tables.setdefault(min(tables, default=PLAIN_ROT), []).extend(plain)
        self.buf = dev.buffer(2 * max(off, 4), label="lora f16 mirrors")
        self._tables = [
            (rot, dev.upload(np.asarray(rows, np.uint32).reshape(-1), label=f"lora mirror rows {rot}"), len(rows))
            for rot, rows in sorted(tables.items())
        ]

    def b16(self, key: tuple[int, str]) -> BufferView:
        """B of adapter `key` as f16 [d_out, r] (the forward's LoRA term, layout "rows")."""
        off, n = self._b[key]
        return BufferView(self.buf, 2 * off, 2 * n)

    def a16(self, key: tuple[int, str]) -> BufferView:
        """A R of adapter `key` as f16 [r, d_in] (the input gradient's LoRA term, layout "cols")."""
        if key not in self._a:
            raise DeviceError(f"LoRA mirrors: no A mirror of {key} (built without a rotation)")
        off, n = self._a[key]
        return BufferView(self.buf, 2 * off, 2 * n)

    def refresh(self, dev: Device, params: Any) -> None:
        """Rewrite every mirror from the f32 parameters (one dispatch per rotation block)."""
        for rot, table, rows in self._tables:
            pipe = pipeline(dev, "lora_mirror", rot=rot, tint=tint(dev))
            dev.dispatch(pipe, [pack(rows, 0, 0, 0), params, table, self.buf], grid(rows, 1))
