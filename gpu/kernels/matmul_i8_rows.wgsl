// Staging of a row-major operand for the integer GEMM (include of matmul_i8.wgsl, filled once per operand by
// gpu/codegen_i8.py): A [M, K], or W [N, K] as B = W^T in the "nt" orientation. BK codes of each of the tile's
// rows per step, each subgroup block's rows [${OP_RB}][LDW] in a block of ${OP_S}.

fn ld_${op}(u: u32, r0: u32, t: u32) -> vec4<u32> {
    let r = min(r0 + u / UPR, prm.${OP_ROWS} - 1u);
    return ${OP}[${OP_OFF}r * prm.${OP_LD} + t * UPR + u % UPR];
}

fn put_${op}(u: u32, v: vec4<u32>, buf: u32) {
    let row = u / UPR;
    let o = (row % ${OP_RB}) * LDW + (u % UPR) * 4u;
    let b = buf * ${OP_SG} + row / ${OP_RB};
    ${OP_S}[b][o] = bitcast<i32>(v.x);
    ${OP_S}[b][o + 1u] = bitcast<i32>(v.y);
    ${OP_S}[b][o + 2u] = bitcast<i32>(v.z);
    ${OP_S}[b][o + 3u] = bitcast<i32>(v.w);
}
