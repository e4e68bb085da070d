// Staging of A for the integer GEMM (include of matmul_i8.wgsl): BK codes of each of the tile's BM rows per step,
// each subgroup row block's rows [A_RB][LDW] in a block of As.

fn ld_a(u: u32, m0: u32, t: u32) -> vec4<u32> {
    let m = min(m0 + u / UPR, prm.M - 1u);
    return A[prm.a_off + m * prm.lda + t * UPR + u % UPR];
}

fn put_a(u: u32, v: vec4<u32>, buf: u32) {
    let row = u / UPR;
    let o = (row % A_RB) * LDW + (u % UPR) * 4u;
    let b = buf * SG_M + row / A_RB;
    As[b][o] = bitcast<i32>(v.x);
    As[b][o + 1u] = bitcast<i32>(v.y);
    As[b][o + 2u] = bitcast<i32>(v.z);
    As[b][o + 3u] = bitcast<i32>(v.w);
}
