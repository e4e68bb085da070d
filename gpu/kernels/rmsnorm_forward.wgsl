${ENABLE_F16}
// RMSNorm forward: Y[t] = X[t] * rstd * w, rstd = 1 / sqrt(mean(X[t]^2) + eps); variant half: also Y16 = f16(Y),
// the f16 A operand of the tensor-core GEMMs that read Y (the rounding gpu/ops/half.py's pack applies).
// One workgroup per row (rows.wgsl); the sum of squares is a strided per-thread sum, then workgroup_reduce.wgsl's
// fixed tree. (This body goes first in the source: the f16 directive must.)

// (Params, X, Wn, Y: rmsnorm_io.wgsl)
${Y16_BINDING}

const WG: u32 = 64u;
alias Reduced = f32;

fn row_main(row: u32, lid: u32) {
    let base = row * prm.H;
    var s = 0.0;
    for (var i = lid; i < prm.H; i += WG) {
        let x = X[base + i];
        s = fma(x, x, s);
    }
    let rstd = 1.0 / sqrt(workgroup_reduce(lid, s) / f32(prm.H) + prm.eps);
    for (var i = lid; i < prm.H; i += WG) {
        let y = X[base + i] * rstd * Wn[i];
        Y[base + i] = y;
        ${Y16_STORE}
    }
}
