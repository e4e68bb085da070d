"""One vocab chunk of the LM head's logits, logits[:, :nv] = h . W[c0:c0+nv]^T (row stride ldc), shared by the
KD loss (gpu/ops/kd.py) and the top-k (gpu/ops/topk.py): a quantized lm_head through the fused-dequant GEMM
(on tensor cores when an f16 copy of h is given), an f32 one through strided_matmul."""

from __future__ import annotations

from typing import Any

from gpu.device import Device
from gpu.ops.matmul import linear
from gpu.ops.matmul_tc import linear_tc
from gpu.ops.strided_matmul import row_major, strided_matmul, transposed
from gpu.weights import QuantTensor, row_slice


def logits_chunk(
    dev: Device, h: Any, w: Any, out: Any, n_tokens: int, hidden: int, c0: int, nv: int, ldc: int, h16: Any = None
) -> None:
    """out [n_tokens, ldc] columns 0..nv-1 = h [n_tokens, hidden] . W[c0:c0+nv]^T. h16: h as f16 (tensor
    cores; the logits then carry h's f16 rounding, README's Numerics)."""
    if isinstance(w, QuantTensor):
        if h16 is not None:
            linear_tc(dev, h16, row_slice(w, c0, nv), out, n_tokens, ldc=ldc, a_dtype="f16")
        else:
            linear(dev, h, row_slice(w, c0, nv), out, n_tokens, ldc=ldc)
        return
    a, b = row_major(h, hidden), transposed(w, hidden, off=c0 * hidden)
    strided_matmul(dev, a, b, out, n_tokens, nv, hidden, ldc=ldc)
