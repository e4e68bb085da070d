// The fused RMSNorms' workgroup (rmsnorm_i8.wgsl, rmsnorm_i8_units.wgsl): 64 invocations a row, and
// workgroup_reduce.wgsl's tree on pairs: the sum of squares in x, the absmax in y.
const WG: u32 = 64u;
alias Reduced = vec2<f32>;   // (sum of squares, absmax)

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec2<f32>(a.x + b.x, max(a.y, b.y));
}

// 1 / sqrt(mean(x^2) + eps) of the row at X[base ..], the squares summed in rmsnorm_forward's order (element i,
// strided by WG, then the tree); every invocation has read it before it returns (the tree is free again)
fn row_rstd(lid: u32, base: u32) -> f32 {
    var s = 0.0;
    var i = lid;
    for (; i + 7u * WG < prm.H; i += 8u * WG) {   // eight loads in flight, then their squares in order
        let x0 = X[base + i];
        let x1 = X[base + i + WG];
        let x2 = X[base + i + 2u * WG];
        let x3 = X[base + i + 3u * WG];
        let x4 = X[base + i + 4u * WG];
        let x5 = X[base + i + 5u * WG];
        let x6 = X[base + i + 6u * WG];
        let x7 = X[base + i + 7u * WG];
        s = fma(x7, x7, fma(x6, x6, fma(x5, x5, fma(x4, x4, fma(x3, x3, fma(x2, x2, fma(x1, x1, fma(x0, x0, s))))))));
    }
    for (; i < prm.H; i += WG) {
        let x = X[base + i];
        s = fma(x, x, s);
    }
    let r = 1.0 / sqrt(workgroup_reduce(lid, vec2<f32>(s, 0.0)).x / f32(prm.H) + prm.eps);
    workgroupBarrier();
    return r;
}

// the row's scale from each invocation's part m of its absmax (int8_codes.wgsl, int8_unit_rows.wgsl)
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, vec2<f32>(0.0, m)).y / 127.0;
}
