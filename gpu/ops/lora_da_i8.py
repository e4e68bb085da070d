"""LoRA's dA = dt^T x on the integer tensor cores, from the int8 codes of x that the projection's forward GEMM took
(gpu/ops/lora_db_i8.py's passes, then lora_sum_i8_finish.wgsl's cols variant and a rotation back).

With precision int8 a projection's input x is quantized for its frozen GEMM, rotated in Walsh-Hadamard blocks: x R
= sx qx (a scale sx per row). dA^T = x^T dt = R qx^T (sx dt), so dA = (sum_m u[m, n] qx[m, k]) R^T with u = sx dt
rounded to 8 bits per column over chunks of rows: the chunks' sums run on the i8 MMAs over qx (one byte a value
instead of the f32 x that lora_matmul reads), a pass adds them times their scales into dA's rows (still rotated),
and hadamard_rows turns each adapter's rows back into its dA. Adapters sharing x (q, k, v; gate, up) take one
product, their dt's side by side as the columns. The numpy twin is bench/int8_activation_kl.py's `:g8`
(dt8_backward). GPUStudent keeps each block's four projection inputs' codes through its backward for it (~109 MB at
the Llama-3-8B shape: gpu/student.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gpu.device import BufferView, Device, DeviceError
from gpu.ops.common import grid, nbytes, pack
from gpu.ops.lora import view_span
from gpu.ops.lora_db_i8 import column_sums, covers
from gpu.ops.matmul_i8 import Int8Matrix, i8_buffers
from gpu.ops.quantize_i8 import rotate_rows
from gpu.profile import scope
from gpu.registry import pipeline

# GPUStudent's int8 backward takes dA from the forward's x codes where it kept them (off: lora_matmul over f32 x).
THIN_DA = True
MAX_ADAPTERS = 4  # adapters sharing x in one product (lora_cols_i8.wgsl's offs)
_rotated: dict[Device, Any] = {}


def da_covers(x: Int8Matrix, r: int, n_adapters: int) -> bool:
    """Whether lora_da_i8 takes the dA's of n_adapters adapters of rank r sharing the int8 operand x."""
    return 0 < n_adapters <= MAX_ADAPTERS and covers(x, r * n_adapters)


def _scratch(dev: Device, size: int) -> Any:
    """The device's buffer for dA's rotated rows (grown to `size` bytes; bind groups stay cached across steps)."""
    have = _rotated.get(dev)
    if have is None or have.size < size:
        have = dev.buffer(max(size, 16, 0 if have is None else have.size), label="lora dA rotated")
        _rotated[dev] = have
    return have


def lora_da_i8(
    dev: Device, x: Int8Matrix, dts: Sequence[Any], das: Sequence[Any], r: int, rot: int, *, accumulate: bool = False
) -> None:
    """dA_j [r, K] (+)= dt_j^T x for the adapters j sharing the input x, from x's int8 codes (x R = sx qx, R the
    rotation in blocks of rot; 0: none): dts and das 4-byte aligned views of one buffer each ([M, r] f32 each, [r, K]
    f32 each; with a rotation, any buffers or views for das)."""
    if len(dts) != len(das) or not da_covers(x, r, len(dts)):
        raise DeviceError(f"lora_da_i8 over {x.name!r}: {len(dts)} adapters of rank {r}, {len(das)} dA's")
    k, n = x.k, r * len(dts)
    span, offs = view_span([_view(v) for v in dts], "dt")
    with scope(dev, "lora"):
        part, cs, splits = column_sums(dev, x, span, offs, r)
        if rot:  # the rotated rows of every dA into a scratch, then each turned back into its dA
            out, at = _scratch(dev, 4 * n * k), tuple(j * r * k for j in range(len(das)))
        else:
            out, at = view_span([_view(v) for v in das], "dA")
        prm = pack(k * n, n, splits, 0, 0, accumulate and not rot, 1.0, r, *at, *(0,) * (4 - len(at)))
        pipe = pipeline(dev, "lora_sum_i8_finish", cols=True)
        dev.dispatch(pipe, [prm, part, cs, out], grid(k * n, 256))
        if rot:
            for j, da in enumerate(das):
                rotate_rows(dev, BufferView(out, 4 * at[j], 4 * r * k), r, k, rot, out=da, add=accumulate)


def _view(v: Any) -> BufferView:
    return v if isinstance(v, BufferView) else BufferView(v, 0, nbytes(v))


# a block's projection inputs by the name of their activation, and the projections reading each
INPUTS = {"n1": ("q", "k", "v"), "att": ("o",), "n2": ("gate", "up"), "s": ("down",)}


class InputCodes:
    """The int8 codes of a block's projection inputs (INPUTS), kept from its forward or recompute to its backward for
    dA from them: a buffer per input, shared by the blocks `layers` (one block's backward at a time)."""

    def __init__(self, dev: Device, rows: int, widths: dict[str, int], layers: set[int]) -> None:
        self.rows, self.widths, self.layers = rows, widths, layers
        self.buffers = {name: i8_buffers(dev, rows, w, w, f"kept {name}") for name, w in widths.items()}

    def at(self, layer: int, name: str) -> Int8Matrix | None:
        """Block `layer`'s codes of input `name`, where they are kept."""
        return self.buffers.get(name) if layer in self.layers else None
