// Staging units of V = 8 consecutive elements (one row of a tile). `u` numbers the units of a tile row
// by row; ld_* read one from memory (as f16), put_* store it into workgroup buffer `buf`, whose tile is
// split in blocks (one array each; see matmul_tc.wgsl): A by rows, B by output columns.
// The plain loaders read a full reduction step (no reduction-index checks); the _edge loaders check every
// index against R and the weight's shape (reduction tail, or "nn" weights with K % 8 != 0).
alias U = H8;

fn ld_a(u: u32, m0: u32, r0: u32) -> H8 {
    let m = min(m0 + u / AU_ROW, prm.M - 1u);
    return a_vec8(prm.a_off + m * prm.lda + r0 + (u % AU_ROW) * 8u);
}

fn ld_a_edge(u: u32, m0: u32, r0: u32) -> H8 {
    let m = min(m0 + u / AU_ROW, prm.M - 1u);
    let r = r0 + (u % AU_ROW) * 8u;
    let i = prm.a_off + m * prm.lda + r;
    let lo = vec4<f16>(a_chk(i, r < prm.R), a_chk(i + 1u, r + 1u < prm.R),
                       a_chk(i + 2u, r + 2u < prm.R), a_chk(i + 3u, r + 3u < prm.R));
    let hi = vec4<f16>(a_chk(i + 4u, r + 4u < prm.R), a_chk(i + 5u, r + 5u < prm.R),
                       a_chk(i + 6u, r + 6u < prm.R), a_chk(i + 7u, r + 7u < prm.R));
    return H8(lo, hi);
}

fn put_a(u: u32, buf: u32, v: H8) {
    let row = u / AU_ROW;
    let blk = buf * A_NB + row / A_RB;
    let o = (row % A_RB) * LDA_S + (u % AU_ROW) * 8u;
    As[blk][o] = v.lo.x;
    As[blk][o + 1u] = v.lo.y;
    As[blk][o + 2u] = v.lo.z;
    As[blk][o + 3u] = v.lo.w;
    As[blk][o + 4u] = v.hi.x;
    As[blk][o + 5u] = v.hi.y;
    As[blk][o + 6u] = v.hi.z;
    As[blk][o + 7u] = v.hi.w;
}

// "nt": a unit = W[n, k..k+7] (8 consecutive r of B column p = n), staged as Bs[n][k].
fn ld_b_nt(u: u32, p0: u32, r0: u32) -> H8 {
    let n = min(p0 + u / BU_ROW, prm.N - 1u);
    return w_vec8(n, r0 + (u % BU_ROW) * 8u, prm.K);
}

fn ld_b_nt_edge(u: u32, p0: u32, r0: u32) -> H8 {
    let n = min(p0 + u / BU_ROW, prm.N - 1u);
    let k = r0 + (u % BU_ROW) * 8u;
    return H8(w4_chk(n, k, k < prm.K), w4_chk(n, k + 4u, k + 4u < prm.K));
}

// "nn": a unit = W[r, p..p+7] (8 consecutive p of B row r), staged as Bs[r][p]. Units past K are clamped
// onto the row's last 8 (their columns of C are never written; needs K % 8 == 0).
fn ld_b_nn(u: u32, p0: u32, r0: u32) -> H8 {
    let p = min(p0 + (u % BU_ROW) * 8u, prm.K - 8u);
    return w_vec8(r0 + u / BU_ROW, p, prm.K);
}

fn ld_b_nn_edge(u: u32, p0: u32, r0: u32) -> H8 {
    let r = r0 + u / BU_ROW;
    let p = p0 + (u % BU_ROW) * 8u;
    return H8(w4_chk(r, p, r < prm.N && p < prm.K), w4_chk(r, p + 4u, r < prm.N && p + 4u < prm.K));
}

fn put_b_nt(u: u32, buf: u32, v: H8) {
    let row = u / BU_ROW;
    let blk = buf * B_NB + row / B_RB;
    let o = (row % B_RB) * LDB_S + (u % BU_ROW) * 8u;
    Bs[blk][o] = v.lo.x;
    Bs[blk][o + 1u] = v.lo.y;
    Bs[blk][o + 2u] = v.lo.z;
    Bs[blk][o + 3u] = v.lo.w;
    Bs[blk][o + 4u] = v.hi.x;
    Bs[blk][o + 5u] = v.hi.y;
    Bs[blk][o + 6u] = v.hi.z;
    Bs[blk][o + 7u] = v.hi.w;
}

fn put_b_nn(u: u32, buf: u32, v: H8) {
    let col = (u % BU_ROW) * 8u;
    let blk = buf * B_NB + col / B_RB;
    let o = (u / BU_ROW) * LDB_S + col % B_RB;
    Bs[blk][o] = v.lo.x;
    Bs[blk][o + 1u] = v.lo.y;
    Bs[blk][o + 2u] = v.lo.z;
    Bs[blk][o + 3u] = v.lo.w;
    Bs[blk][o + 4u] = v.hi.x;
    Bs[blk][o + 5u] = v.hi.y;
    Bs[blk][o + 6u] = v.hi.z;
    Bs[blk][o + 7u] = v.hi.w;
}
