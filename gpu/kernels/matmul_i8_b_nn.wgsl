// Staging of B = W for the integer GEMM's "nn" orientation (include of matmul_i8.wgsl): W [K, N] (prm.ldw vec4
// units a row; N a multiple of 16). The tensor cores want each column's K codes four to a word (as the "nt"
// staging has them), so a staging unit is 4 rows x 16 columns of W, read as four vec4 (one per row) and stored
// byte-transposed: 16 words, each one column's 4 codes, into the subgroup column block's [B_RB][LDW] rows.
// Consecutive units take consecutive quads of rows (KQ per step), then the next 16 columns.
const KQ: u32 = BK / 4u;   // row quads per staged step

fn ld_b(u: u32, n0: u32, t: u32) -> array<vec4<u32>, 4> {
    let p = min(n0 / 16u + u / KQ, prm.N / 16u - 1u);   // columns past N are clamped (never written)
    let k = t * BK + (u % KQ) * 4u;
    return array<vec4<u32>, 4>(
        W[k * prm.ldw + p],
        W[(k + 1u) * prm.ldw + p],
        W[(k + 2u) * prm.ldw + p],
        W[(k + 3u) * prm.ldw + p],
    );
}

// 4 x 4 byte transpose: word e of the result holds byte e of x0, x1, x2, x3 (in that order, low byte first)
fn transpose4(x0: u32, x1: u32, x2: u32, x3: u32) -> vec4<u32> {
    let t0 = (x0 & 0x00ff00ffu) | ((x1 & 0x00ff00ffu) << 8u);
    let t1 = ((x0 >> 8u) & 0x00ff00ffu) | (x1 & 0xff00ff00u);
    let t2 = (x2 & 0x00ff00ffu) | ((x3 & 0x00ff00ffu) << 8u);
    let t3 = ((x2 >> 8u) & 0x00ff00ffu) | (x3 & 0xff00ff00u);
    return vec4<u32>(
        (t0 & 0xffffu) | (t2 << 16u),
        (t1 & 0xffffu) | (t3 << 16u),
        (t0 >> 16u) | (t2 & 0xffff0000u),
        (t1 >> 16u) | (t3 & 0xffff0000u),
    );
}

fn put_b(u: u32, r: array<vec4<u32>, 4>, buf: u32) {
    let col = (u / KQ) * 16u;
    let b = buf * SG_N + col / B_RB;
    let o = (col % B_RB) * LDW + u % KQ;
    for (var j = 0u; j < 4u; j++) {
        let q = transpose4(r[0][j], r[1][j], r[2][j], r[3][j]);
        for (var e = 0u; e < 4u; e++) {
            Bs[b][o + (4u * j + e) * LDW] = bitcast<i32>(q[e]);
        }
    }
}
