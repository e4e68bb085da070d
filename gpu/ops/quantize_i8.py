"""int8 operands of the integer GEMM: activations to codes with per-(row, chunk) scales (gpu/kernels/quantize_i8.wgsl)
and frozen weights to codes with per-row scales, decoded from their GGML type (gpu/kernels/weight_i8.wgsl); the
numpy twin of both is model/int8.py quantize_i8. Either may rotate its rows first in Walsh-Hadamard blocks of rot
(model/int8.py hadamard_rows; both operands of a GEMM alike), and rotate_rows turns a GEMM's rotated result back.
Weight codes transposed (gpu/kernels/transpose_i8.wgsl) for the input gradient on the forward's GEMM."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gpu.device import BufferView, Device, DeviceError
from gpu.ops.common import grid, nbytes, pack
from gpu.ops.matmul_i8 import Int8Matrix, i8_buffers
from gpu.registry import pipeline
from gpu.weights import QuantTensor
from model.int8 import GLU_BACK_SLOTS, GLU_BACK_WORKGROUPS, NORM_TURNED_MAX, ROTATED_MAX, ROTATIONS, SHORT_ROW


def tint(dev: Device) -> bool:
    """Whether dev compiles WGSL with Tint (Dawn), whose subgroup builtins need `enable subgroups;`."""
    return dev.backend == "dawn"


# Invocations a row of the quantizer and the Q4_K decode for rows of at most SHORT_ROW values: 64 (more rows in flight
# per multiprocessor: the 8B step on an H100, 2026-12-06, 4,854 against 4,808 tokens/s; the decode 25.5 against
# 42.5 ms), or 256; longer rows 256.
SHORT_ROW_WORKGROUP = 64


def row_workgroup(k: int) -> int:
    """The workgroup size a row of k values runs with in quantize_i8 / weight_i8_q4_k."""
    return SHORT_ROW_WORKGROUP if k <= SHORT_ROW else 256


def check_rotation(rot: int, k: int, what: str) -> None:
    """rot must be one of ROTATIONS dividing k, and a rotated row hold at most ROTATED_MAX values."""
    if rot not in ROTATIONS or (rot and (k % rot or k > ROTATED_MAX)):
        raise DeviceError(f"{what}: rotation {rot} for rows of {k} (one of {ROTATIONS} dividing k <= {ROTATED_MAX})")


# rmsnorm_i8, glu_i8 and quantize_i8_gpu of rotated rows on their units kernels (the row read once, as units of 16,
# rotated once: int8_units.wgsl) instead of int8_codes.wgsl's rotated rows (each vec4 read and rotated twice);
# the same bits either way (bench/int8_prep.py times both, bench/train_step.py --ab unit-rows-off)
UNIT_ROWS = True
# rmsnorm_i8 / glu_i8 with store_y=False leave y unwritten on the rotated units' kernels (GPUStudent: where every
# reader of a projection input takes its codes); off: y is always written
CODES_ALONE = True
# rows a workgroup of quantize_i8_gpu quantizes one after the other when they are times column scales (the input
# gradients' dY * W's row scales): each invocation reads the same scales for every row (bench/train_step.py --ab
# quantize-rows-4); the same bits whatever the value
SCALED_ROWS_PER_WORKGROUP = 1


def quantize_i8_gpu(
    dev: Device,
    x: Any,
    out: Int8Matrix,
    *,
    ldx: int | None = None,
    x_offset: int = 0,
    col_scales: Any = None,
    rot: int = 0,
) -> None:
    """out <- int8 codes and scales of the f32 rows x[out.rows, out.k] (row stride ldx, default k), each element
    first multiplied by col_scales[k] when given (f32, out.k values), each chunk rotated in blocks of rot."""
    ldx = out.k if ldx is None else ldx
    check_rotation(rot, out.chunk, f"quantize_i8 of {out.name!r}")
    need = 4 * (x_offset + (out.rows - 1) * ldx + out.k)
    if out.rows > 0 and nbytes(x) < need:
        raise DeviceError(f"quantize_i8 of {out.name!r}: input has {nbytes(x)} bytes, needs {need}")
    if col_scales is not None and nbytes(col_scales) < 4 * out.k:
        raise DeviceError(f"quantize_i8 of {out.name!r}: col_scales hold fewer than {out.k} values")
    if out.rows > int(dev.limits.get("max-compute-workgroups-per-dimension", 65535)):
        raise DeviceError(f"quantize_i8 of {out.name!r}: {out.rows} rows exceed the workgroups per dimension")
    per_wg = SCALED_ROWS_PER_WORKGROUP if col_scales is not None else 1
    prm = np.array([out.k, ldx, x_offset, out.chunk, out.chunks, out.rows, per_wg, 0], np.uint32)
    bindings = [prm, x, out.codes, out.scales] + ([] if col_scales is None else [col_scales])
    # vec4 loads where every row's chunks start on a 16-byte boundary (and the bound views are whole vec4s)
    vec4 = x_offset % 4 == 0 and ldx % 4 == 0 and nbytes(x) % 16 == 0
    vec4 = vec4 and (col_scales is None or nbytes(col_scales) % 16 == 0)
    wg = row_workgroup(out.chunk)
    scaled = col_scales is not None
    if rot and vec4 and UNIT_ROWS and out.chunk <= 64 * wg:  # units of 16 (rot >= 32 divides the chunk)
        pipe = pipeline(dev, "quantize_i8_units", scaled=scaled, rot=rot, tint=tint(dev), wg=wg)
    else:
        pipe = pipeline(dev, "quantize_i8", scaled=scaled, vec4=vec4, rot=rot, tint=tint(dev), wg=wg)
    dev.dispatch(pipe, bindings, (out.chunks, math.ceil(out.rows / per_wg)))


FUSED_NORM_ROTATED_WIDTH = 4096  # rmsnorm_i8 holds a rotated row in its 64 invocations' registers: 64 x 16 x 4


def rmsnorm_i8(
    dev: Device, x: Any, w: Any, y: Any, out: Int8Matrix, eps: float, rot: int = 0, *, store_y: bool = True
) -> None:
    """y[out.rows, out.k] = RMSNorm(x) with weight w (bitwise rmsnorm_forward's) and out <- y's int8 codes and per-row
    scales, rotated in blocks of rot (bitwise quantize_i8_gpu's of y), in one pass over each row
    (gpu/kernels/rmsnorm_i8.wgsl): the row's codes without reading y back. Rows of a multiple of 4; rotated, of at
    most FUSED_NORM_ROTATED_WIDTH. store_y=False: y may be left unwritten (the rotated units' kernel skips it)."""
    rows, h = out.rows, out.k
    check_rotation(rot, h, f"rmsnorm_i8 of {out.name!r}")
    if h % 4 or out.chunks != 1 or (rot and h > FUSED_NORM_ROTATED_WIDTH):
        raise DeviceError(f"rmsnorm_i8 of {out.name!r}: rows of {h} in {out.chunks} chunks (rotation {rot})")
    for buf, n, what in ((x, rows * h, "x"), (w, h, "weight"), (y, rows * h, "y")):
        if nbytes(buf) < 4 * n:
            raise DeviceError(f"rmsnorm_i8 of {out.name!r}: {what} has {nbytes(buf)} bytes, needs {4 * n}")
    units = bool(rot and UNIT_ROWS)  # rot >= 32 divides h: units of 16, at most 4 an invocation
    bindings = [pack(rows, h, float(eps), units and not store_y and CODES_ALONE), x, w, y, out.codes, out.scales]
    if units:
        dev.dispatch(pipeline(dev, "rmsnorm_i8_units", rot=rot, tint=tint(dev)), [*bindings, x], grid(rows, 1))
        return
    dev.dispatch(pipeline(dev, "rmsnorm_i8", rot=rot, tint=tint(dev)), bindings, grid(rows, 1))


def rmsnorm_backward_i8(
    dev: Device,
    dy: Any,
    x: Any,
    w: Any,
    dx: Any,
    out: Int8Matrix,
    col_scales: Any,
    eps: float,
    residual: Any = None,
    *,
    dy_rot: int = 0,
) -> None:
    """dx[out.rows, out.k] = the RMSNorm's input gradient (weight w, rstd recomputed from x) applied to dy, plus
    residual when given (bitwise the scalar rmsnorm_backward's, VEC4_BACKWARD off, with dx = residual and
    accumulate), and out <- the int8 codes and per-row scales of dx * col_scales (the consuming projection's
    weight row scales; bitwise quantize_i8_gpu's with col_scales), in one pass over each row
    (gpu/kernels/rmsnorm_back_i8.wgsl). residual must not be dx. dy_rot: dy holds dY R, rotated in blocks of dy_rot
    (rows of at most NORM_TURNED_MAX): turned back first, bitwise rotate_rows's, dy itself unchanged."""
    rows, h = out.rows, out.k
    if h % 4 or out.chunks != 1:
        raise DeviceError(f"rmsnorm_backward_i8 of {out.name!r}: rows of {h} in {out.chunks} chunks")
    if dy_rot:
        check_rotation(dy_rot, h, f"rmsnorm_backward_i8 of {out.name!r}")
        if h > NORM_TURNED_MAX:
            raise DeviceError(f"rmsnorm_backward_i8 of {out.name!r}: a rotated dy of rows of {h} > {NORM_TURNED_MAX}")
    named = [
        (dy, rows * h, "dy"),
        (x, rows * h, "x"),
        (w, h, "weight"),
        (dx, rows * h, "dx"),
        (col_scales, h, "scales"),
    ]
    if residual is not None:
        named.append((residual, rows * h, "residual"))
    for buf, n, what in named:
        if nbytes(buf) < 4 * n:
            raise DeviceError(f"rmsnorm_backward_i8 of {out.name!r}: {what} has {nbytes(buf)} bytes, needs {4 * n}")
    if residual is dx:
        raise DeviceError(f"rmsnorm_backward_i8 of {out.name!r}: the residual must be another buffer than dx")
    pipe = pipeline(dev, "rmsnorm_back_i8", rot=dy_rot, tint=tint(dev))
    r = dy if residual is None else residual
    prm = pack(rows, h, float(eps), residual is not None)
    dev.dispatch(pipe, [prm, dy, x, w, r, dx, col_scales, out.codes, out.scales], grid(rows, 1))


def glu_i8(
    dev: Device, act: str, g: Any, u: Any, y: Any, out: Int8Matrix, rot: int = 0, *, store_y: bool = True
) -> None:
    """y[out.rows, out.k] = act(g) * u, act "swiglu" or "geglu" (bitwise swiglu_forward's / geglu_forward's), and
    out <- y's int8 codes and per-row scales, rotated in blocks of rot (bitwise quantize_i8_gpu's of y), in one pass
    over each row (gpu/kernels/glu_i8.wgsl). Rows of a multiple of 4; rotated, of at most 64 x the row's
    invocations. store_y=False: y may be left unwritten (the rotated units' kernel skips it)."""
    rows, f = out.rows, out.k
    wg = row_workgroup(f)
    check_rotation(rot, f, f"glu_i8 of {out.name!r}")
    if f % 4 or out.chunks != 1 or (rot and f > 64 * wg):
        raise DeviceError(f"glu_i8 of {out.name!r}: rows of {f} in {out.chunks} chunks (rotation {rot})")
    for buf, what in ((g, "g"), (u, "u"), (y, "y")):
        if nbytes(buf) < 4 * rows * f:
            raise DeviceError(f"glu_i8 of {out.name!r}: {what} has {nbytes(buf)} bytes, needs {4 * rows * f}")
    name = "glu_i8_units" if rot and UNIT_ROWS else "glu_i8"  # units: rot >= 32 divides f, at most 4 an invocation
    pipe = pipeline(dev, name, act=act, rot=rot, tint=tint(dev), wg=wg)
    skip = name == "glu_i8_units" and not store_y and CODES_ALONE
    dev.dispatch(pipe, [pack(rows, f, skip, 0), g, u, y, out.codes, out.scales], grid(rows, 1))


def glu_back_workgroup(dev: Device, f: int) -> int | None:
    """The invocations a row of f values of glu_backward_i8 runs with (the fewest whose registers hold it), or None
    where none of the device's does."""
    limit = dev.limits.get("max-compute-invocations-per-workgroup", 256)
    fits = [wg for wg in GLU_BACK_WORKGROUPS if wg <= limit and 4 * GLU_BACK_SLOTS * wg >= f]
    return fits[0] if fits and f % 4 == 0 else None


def glu_backward_i8(
    dev: Device,
    act: str,
    dy: Any,
    g: Any,
    u: Any,
    dg: Any,
    cg: Any,
    cu: Any,
    dg_i8: Int8Matrix,
    du_i8: Int8Matrix,
    *,
    store_grads: bool = True,
    dy_rot: int = 0,
) -> None:
    """The backward of y = act(g) * u (act "swiglu" or "geglu") over dg_i8.rows rows of dg_i8.k: dg, and du over u
    (bitwise swiglu_backward's / geglu_backward's; store_grads=False leaves dg and u as they were: every reader takes
    the codes), and their int8 operands for the input-gradient GEMMs, dg * cg into dg_i8 and du * cu into du_i8 (cg,
    cu: the gate and up weights' row scales; bitwise quantize_i8_gpu's with col_scales), in one read of each row held
    in registers (gpu/kernels/glu_back_i8.wgsl; rows glu_back_workgroup covers). dy_rot: dy holds dY R, rotated in
    blocks of dy_rot (the down projection's input gradient over rotated codes), turned back as it is read (bitwise
    rotate_rows's). dg_i8 and du_i8: i8_pair's two operands (one buffer of codes, one of scales)."""
    rows, f = dg_i8.rows, dg_i8.k
    wg = glu_back_workgroup(dev, f)
    check_rotation(dy_rot, f, "glu_backward_i8's dy")
    if (du_i8.rows, du_i8.k) != (rows, f) or wg is None or dg_i8.chunks != 1:
        raise DeviceError(f"glu_backward_i8: operands of {rows} x {f} and {du_i8.rows} x {du_i8.k}")
    for buf, n, what in ((dy, rows * f, "dy"), (g, rows * f, "g"), (u, rows * f, "u"), (dg, rows * f, "dg")):
        if nbytes(buf) < 4 * n:
            raise DeviceError(f"glu_backward_i8: {what} has {nbytes(buf)} bytes, needs {4 * n}")
    for buf, what in ((cg, "gate scales"), (cu, "up scales")):
        if nbytes(buf) < 4 * f:
            raise DeviceError(f"glu_backward_i8: {what} hold fewer than {f} values")
    first, second = (dg_i8.codes, dg_i8.scales), (du_i8.codes, du_i8.scales)
    views = [v for pair in (first, second) for v in pair]
    if not all(isinstance(v, BufferView) for v in views) or any(
        a.buffer is not b.buffer for a, b in zip(first, second, strict=True)
    ):
        raise DeviceError("glu_backward_i8: dg's and du's operands must share their buffers (i8_pair)")
    codes = BufferView(first[0].buffer, first[0].offset, second[0].offset - first[0].offset + rows * f)
    scales = BufferView(first[1].buffer, first[1].offset, second[1].offset - first[1].offset + 4 * rows)
    q1, s1 = (second[0].offset - first[0].offset) // 4, (second[1].offset - first[1].offset) // 4
    pipe = pipeline(dev, "glu_back_i8", act=act, rot=dy_rot, tint=tint(dev), wg=wg)
    params = pack(rows, f, q1, s1, 0 if store_grads else 1, 0, 0, 0)
    dev.dispatch(pipe, [params, dy, g, u, dg, cg, cu, codes, scales], grid(rows, 1))


def i8_pair(codes: Any, scales: Any, rows: int, k: int, align: int, name: str = "") -> tuple[Int8Matrix, Int8Matrix]:
    """Two rows x k int8 operands in one buffer of codes and one of scales (glu_backward_i8's dg and du), the second
    at the first offset past the first that a binding may start at (align: the device's offset alignment);
    pair_bytes says how large the buffers must be."""
    (q1, s1), (q_size, s_size) = _pair_offsets(rows, k, align), pair_bytes(rows, k, align)
    if nbytes(codes) < q_size or nbytes(scales) < s_size:
        raise DeviceError(f"i8_pair {name!r}: buffers of {nbytes(codes)} and {nbytes(scales)} bytes hold less than two")
    return (
        Int8Matrix(BufferView(codes, 0, rows * k), BufferView(scales, 0, 4 * rows), rows, k, k, f"{name} 0"),
        Int8Matrix(BufferView(codes, q1, rows * k), BufferView(scales, s1, 4 * rows), rows, k, k, f"{name} 1"),
    )


def pair_bytes(rows: int, k: int, align: int) -> tuple[int, int]:
    """(codes, scales) bytes of i8_pair's buffers for two rows x k operands."""
    q1, s1 = _pair_offsets(rows, k, align)
    return q1 + rows * k, s1 + 4 * rows


def _pair_offsets(rows: int, k: int, align: int) -> tuple[int, int]:
    return -(-rows * k // align) * align, -(-4 * rows // align) * align


def weight_to_i8(
    dev: Device, w: QuantTensor, out: Int8Matrix | None = None, rot: int = 0, *, fixed_scales: bool = False
) -> Int8Matrix:
    """The int8 codes and per-row scales of a frozen weight (n, k), decoded on the GPU from its GGML type
    (gpu/kernels/weight_i8.wgsl; Q4_K from whole 16-byte pieces of its blocks, weight_i8_q4_k.wgsl) and
    rotated in blocks of rot into `out` (n rows of k, one chunk) or new buffers; k must be a multiple of 32 (one
    integer multiply-accumulate step). fixed_scales: out.scales hold this weight's row scales already (an earlier
    decode's, with the same rot): the codes alone, without the absmax over each row (the same codes)."""
    n, k = w.shape
    check_rotation(rot, k, f"weight_to_i8 {w.name!r}")
    if fixed_scales and out is None:
        raise DeviceError(f"weight_to_i8 {w.name!r}: fixed_scales needs `out` with the row scales")
    if out is None:
        out = i8_buffers(dev, n, k, k, w.name)
    elif (out.rows, out.k, out.chunks) != (n, k, 1):
        raise DeviceError(f"weight_to_i8 {w.name!r}: {n} x {k} into int8 buffers of {out.rows} x {out.k}")
    variant = {"rot": rot, "tint": tint(dev), "fixed": fixed_scales}
    name = "weight_i8_q4_k" if w.qtype.name == "Q4_K" else "weight_i8"
    variant |= {"wg": row_workgroup(k)} if name == "weight_i8_q4_k" else {"wtype": w.qtype.name}
    dev.dispatch(pipeline(dev, name, **variant), [pack(n, k, 0, 0), w.binding, out.codes, out.scales], grid(n, 1))
    return out


def transpose_i8(dev: Device, w: Int8Matrix, codes: Any, scales: Any, name: str = "") -> Int8Matrix:
    """W's codes transposed into `codes` ([w.k rows, w.rows], one chunk) with `scales` as the rows' scales (the
    caller's: W's own per-row scales run along the transposed rows, so the input gradient folds them into dY).
    w.rows and w.k must be multiples of 4."""
    n, k = w.rows, w.k
    if n % 4 or k % 4 or w.chunks != 1:
        raise DeviceError(f"transpose_i8 {w.name!r}: {n} x {k} in {w.chunks} chunks, needs multiples of 4, one chunk")
    if nbytes(codes) < n * k or nbytes(scales) < 4 * k:
        raise DeviceError(f"transpose_i8 {w.name!r}: output holds fewer than {k} rows of {n} codes and scales")
    dev.dispatch(pipeline(dev, "transpose_i8"), [pack(n, k, 0, 0), w.codes, codes], (-(-k // 64), -(-n // 64), 1))
    return Int8Matrix(codes, scales, k, n, n, name or f"{w.name} transposed")


def rotate_rows(
    dev: Device, x: Any, rows: int, k: int, rot: int, out: Any = None, *, forward: bool = False, add: bool = True
) -> None:
    """x[rows, k] <- x R^T in place, or out += x R^T (add=False: out = x R^T) (f32, row-major): R the operands'
    rotation in blocks of rot (R R^T = I; model/int8.py hadamard_rows back=True), for the input gradient dX = (dY . W
    R) R^T of a GEMM over rotated weight codes. forward=True: out = x R (out required), e.g. a LoRA A rotated like
    the weight codes."""
    check_rotation(rot, k, "rotate_rows")
    if rot == 0 or k % 4:
        raise DeviceError(f"rotate_rows: rotation {rot} for rows of {k}: needs a rotation and k % 4 == 0")
    if forward and out is None:
        raise DeviceError("rotate_rows: forward=True writes into `out`, none given")
    if nbytes(x) < 4 * rows * k or (out is not None and nbytes(out) < 4 * rows * k):
        raise DeviceError(f"rotate_rows: buffers hold fewer than {rows} rows of {k}")
    if rows <= 0:
        return
    bindings = [pack(rows, k, 0, 0), x] + ([] if out is None else [out])
    mode = "forward" if forward else "back" if out is None else "back_add" if add else "back_to"
    dev.dispatch(pipeline(dev, "hadamard_rows", rot=rot, mode=mode, tint=tint(dev)), bindings, grid(rows, 1))


def rotated_back(
    dev: Device,
    gemm: Callable[[Any, bool], None],
    dx: Any,
    rows: int,
    k: int,
    rot: int,
    accumulate: bool,
    scratch: Callable[[], Any],
) -> None:
    """dx (+)= a GEMM's result over operands rotated in blocks of rot, turned back: gemm(out, accumulate) writes
    it into dx (rotated back in place) or, to be added to dx, into scratch() (rows x k f32); rot 0: gemm(dx,
    accumulate) alone."""
    if rot == 0:
        gemm(dx, accumulate)
        return
    out = scratch() if accumulate else dx
    gemm(out, False)
    rotate_rows(dev, out, rows, k, rot, out=dx if accumulate else None)
