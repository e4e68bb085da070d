"""Template values of lora_gemm (gpu/kernels/lora_gemm.wgsl): its tile constants, and each thread's staging of
a reduction step written out as straight-line statements (one register vec4 per staging unit). Loops over the
units with a load feeding a register array ran one memory latency per unit on the H200; unrolled, every load
of a step is in flight at once."""

from __future__ import annotations

BM = 64  # output rows per workgroup
LORA_GEMM_BK = {16: 32, 64: 16}  # output tile width -> reduction steps staged per tile


def lora_gemm_values(bn: int) -> dict[str, object]:
    """${BN}, ${BK} and the unrolled ${DECLARE}, ${LOAD}, ${STAGE} statements for tile width bn."""
    bk = LORA_GEMM_BK[bn]
    tm, tn = BM // 4, bn // 4
    threads = tm * tn
    units = {"a": bk * tm // threads, "b": bk * tn // threads}
    regs = [(op, j) for op in "ab" for j in range(units[op])]
    return {
        "BN": bn,
        "BK": bk,
        "DECLARE": "\n    ".join(f"var r{op}{j} = vec4<f32>(0.0);" for op, j in regs),
        "LOAD": "\n        ".join(f"r{op}{j} = load_{op}(l + {j * threads}u, m0, n0, kl, k_end);" for op, j in regs),
        "STAGE": "\n        ".join(f"stage_{op}(l + {j * threads}u, r{op}{j});" for op, j in regs),
    }
