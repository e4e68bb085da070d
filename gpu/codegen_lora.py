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


# lora_stream.wgsl: invocations along m per row group (4 columns each), row groups; its variants' rows an invocation
# loads at a time (the loads in flight against the registers they hold)
STREAM_COLS, STREAM_ROW_GROUPS, STREAM_UNROLLS = 64, 2, (2, 4)
# lora_rows.wgsl: rows a workgroup (one per invocation), reduction steps staged at a time
ROWS_ROWS, ROWS_BK = 128, 32
_XYZW = "xyzw"


def lora_stream_values(unroll: int) -> dict[str, object]:
    """lora_stream.wgsl's constants and its unrolled statements: 16 accumulators acc{i}{q} (column m + i, ranks
    4 q .. 4 q + 3), UNROLL rows' loads then their products, the row groups' sums added in ascending group order
    through Red (group g > 0 stores, group 0 adds, one group at a time)."""
    acc = [(i, q) for i in range(4) for q in range(4)]
    rows = range(unroll)
    load = [f"let k{j} = k + {j}u * ROW_GROUPS;\n        let x{j} = a_row(k{j}, m, k_end);" for j in rows]
    load += [f"let s{j}{q} = s_row(k{j}, s0 + {4 * q}u, n0 + {4 * q}u, k_end);" for j in rows for q in range(4)]
    fma = [f"acc{i}{q} = fma(vec4<f32>(x{j}.{_XYZW[i]}), s{j}{q}, acc{i}{q});" for j in rows for i, q in acc]
    reduce = []
    for grp in range(1, STREAM_ROW_GROUPS):
        put = " ".join(f"Red[c * 16u + {4 * i + q}u] = acc{i}{q};" for i, q in acc)
        add = " ".join(f"acc{i}{q} += Red[c * 16u + {4 * i + q}u];" for i, q in acc)
        barrier = "workgroupBarrier();"
        reduce += [f"if (g == {grp}u) {{ {put} }}", barrier, f"if (g == 0u) {{ {add} }}", barrier]
    store = [f"put_out4(m + {i}u, n0 + {4 * q}u, z, acc{i}{q});" for i, q in acc]
    return {
        "COLS": STREAM_COLS,
        "ROW_GROUPS": STREAM_ROW_GROUPS,
        "UNROLL": unroll,
        "RED_LEN": STREAM_COLS * 16,
        "DECLARE": "\n    ".join(f"var acc{i}{q} = vec4<f32>(0.0);" for i, q in acc),
        "LOAD": "\n        ".join(load),
        "FMA": "\n        ".join(fma),
        "REDUCE": "\n    ".join(reduce),
        "STORE": "\n        ".join(store),
    }


def lora_rows_values(s_kfast: bool) -> dict[str, object]:
    """lora_rows.wgsl's constants and its unrolled staging (rx{e}: this invocation's vec4s of a step of A) and
    products (the 4 k of one staged vec4 against the step's S rows, read by every invocation at once)."""
    units = ROWS_ROWS * ROWS_BK // 4
    if units % ROWS_ROWS or ROWS_ROWS < 4 * ROWS_BK:
        raise ValueError(f"lora_rows: {ROWS_ROWS} rows cannot stage BK {ROWS_BK} (needs rows >= 4 BK)")
    regs = range(units // ROWS_ROWS)
    fma = []
    for e in range(4):
        fma += [f"let s{e}{j} = Ss[(4u * q + {e}u) * 4u + {j}u];" for j in range(4)]
        fma += [f"acc{j} = fma(vec4<f32>(x.{_XYZW[e]}), s{e}{j}, acc{j});" for j in range(4)]
    return {
        "ROWS": ROWS_ROWS,
        "BK": ROWS_BK,
        "S_KFAST": s_kfast,
        "DECLARE": "\n    ".join(f"var rx{e} = vec4<f32>(0.0);" for e in regs),
        "LOAD": "\n        ".join(f"rx{e} = load_x(lid + {e * ROWS_ROWS}u, m0, kl, k_end);" for e in regs),
        "STAGE": "\n        ".join(f"stage_x(lid + {e * ROWS_ROWS}u, rx{e});" for e in regs),
        "FMA": "\n            ".join(fma),
    }
