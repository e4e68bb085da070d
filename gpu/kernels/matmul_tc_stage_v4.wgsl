// Staging units of V = 4 consecutive elements (one row of a tile). `u` numbers the units of a tile row
// by row; ld_* read one from memory (as f16), put_* store it into workgroup buffer `buf`, whose tile is
// split in blocks (one array each; see matmul_tc.wgsl): A by rows, B by output columns.
// The plain loaders read a full reduction step (no reduction-index checks); the _edge loaders check every
// index against R and the weight's shape (reduction tail).
alias U = vec4<f16>;

fn ld_a(u: u32, m0: u32, r0: u32) -> vec4<f16> {
    let m = min(m0 + u / AU_ROW, prm.M - 1u);
    return a_vec4(prm.a_off + m * prm.lda + r0 + (u % AU_ROW) * 4u);
}

fn ld_a_edge(u: u32, m0: u32, r0: u32) -> vec4<f16> {
    let m = min(m0 + u / AU_ROW, prm.M - 1u);
    let r = r0 + (u % AU_ROW) * 4u;
    let i = prm.a_off + m * prm.lda + r;
    return vec4<f16>(a_chk(i, r < prm.R), a_chk(i + 1u, r + 1u < prm.R),
                     a_chk(i + 2u, r + 2u < prm.R), a_chk(i + 3u, r + 3u < prm.R));
}

fn put_a(u: u32, buf: u32, v: vec4<f16>) {
    let row = u / AU_ROW;
    let blk = buf * A_NB + row / A_RB;
    let o = (row % A_RB) * LDA_S + (u % AU_ROW) * 4u;
    As[blk][o] = v.x;
    As[blk][o + 1u] = v.y;
    As[blk][o + 2u] = v.z;
    As[blk][o + 3u] = v.w;
}

// "nt": a unit = W[n, k..k+3] (4 consecutive r of B column p = n), staged as Bs[n][k].
fn ld_b_nt(u: u32, p0: u32, r0: u32) -> vec4<f16> {
    let n = min(p0 + u / BU_ROW, prm.N - 1u);
    return vec4<f16>(decode4(n, r0 + (u % BU_ROW) * 4u, prm.K));
}

fn ld_b_nt_edge(u: u32, p0: u32, r0: u32) -> vec4<f16> {
    let n = min(p0 + u / BU_ROW, prm.N - 1u);
    let k = r0 + (u % BU_ROW) * 4u;
    return w4_chk(n, k, k < prm.K);
}

// "nn": a unit = W[r, p..p+3] (4 consecutive p of B row r), staged as Bs[r][p]. Units past K are clamped
// onto the row's last 4 (their columns of C are never written).
fn ld_b_nn(u: u32, p0: u32, r0: u32) -> vec4<f16> {
    let p = min(p0 + (u % BU_ROW) * 4u, prm.K - 4u);
    return vec4<f16>(decode4(r0 + u / BU_ROW, p, prm.K));
}

fn ld_b_nn_edge(u: u32, p0: u32, r0: u32) -> vec4<f16> {
    let r = r0 + u / BU_ROW;
    let p = p0 + (u % BU_ROW) * 4u;
    return w4_chk(r, p, r < prm.N && p < prm.K);
}

fn put_b_nt(u: u32, buf: u32, v: vec4<f16>) {
    let row = u / BU_ROW;
    let blk = buf * B_NB + row / B_RB;
    let o = (row % B_RB) * LDB_S + (u % BU_ROW) * 4u;
    Bs[blk][o] = v.x;
    Bs[blk][o + 1u] = v.y;
    Bs[blk][o + 2u] = v.z;
    Bs[blk][o + 3u] = v.w;
}

fn put_b_nn(u: u32, buf: u32, v: vec4<f16>) {
    let col = (u % BU_ROW) * 4u;
    let blk = buf * B_NB + col / B_RB;
    let o = (u / BU_ROW) * LDB_S + col % B_RB;
    Bs[blk][o] = v.x;
    Bs[blk][o + 1u] = v.y;
    Bs[blk][o + 2u] = v.z;
    Bs[blk][o + 3u] = v.w;
}
