// Staging of B = W for the integer GEMM's "nn" orientation (include of matmul_i8.wgsl): W [K, N] (prm.ldw vec4
// units a row; N a multiple of 16), the tile's BN columns of BK rows of W per step, each subgroup column block's
// columns [BK][LDB] (row-major) in a block of Bs.
const UPC: u32 = BN / 16u;            // staged vec4 units per row of the B tile
const LDB: u32 = B_RB / 4u + ${PAD}u;  // words per staged row of a B block (padded)

fn ld_b(u: u32, n0: u32, t: u32) -> vec4<u32> {
    let p = min(n0 / 16u + u % UPC, prm.N / 16u - 1u);   // columns past N are clamped (never written)
    return W[(t * BK + u / UPC) * prm.ldw + p];
}

fn put_b(u: u32, v: vec4<u32>, buf: u32) {
    let col = (u % UPC) * 16u;
    let o = (u / UPC) * LDB + (col % B_RB) / 4u;
    let b = buf * SG_N + col / B_RB;
    Bs[b][o] = bitcast<i32>(v.x);
    Bs[b][o + 1u] = bitcast<i32>(v.y);
    Bs[b][o + 2u] = bitcast<i32>(v.z);
    Bs[b][o + 3u] = bitcast<i32>(v.w);
}
