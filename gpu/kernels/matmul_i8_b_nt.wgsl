// Staging of B = W^T for the integer GEMM's "nt" orientation (include of matmul_i8.wgsl): W [N, K], BK codes of
// each of the tile's BN rows of W per step, each subgroup column block's rows [B_RB][LDW] in a block of Bs.

fn ld_b(u: u32, n0: u32, t: u32) -> vec4<u32> {
    let n = min(n0 + u / UPR, prm.N - 1u);
    return W[n * prm.ldw + t * UPR + u % UPR];
}

fn put_b(u: u32, v: vec4<u32>, buf: u32) {
    let row = u / UPR;
    let o = (row % B_RB) * LDW + (u % UPR) * 4u;
    let b = buf * SG_N + row / B_RB;
    Bs[b][o] = bitcast<i32>(v.x);
    Bs[b][o + 1u] = bitcast<i32>(v.y);
    Bs[b][o + 2u] = bitcast<i32>(v.z);
    Bs[b][o + 3u] = bitcast<i32>(v.w);
}
