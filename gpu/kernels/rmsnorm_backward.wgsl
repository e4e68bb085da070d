// RMSNorm backward over scalars (rmsnorm_backward_io.wgsl): each invocation's elements strided by WG, the row read
// twice (its sums, then the output).

const WG: u32 = 64u;
alias Reduced = vec2<f32>;

fn row_main(row: u32, lid: u32) {
    let base = row * prm.H;
    var sxx = 0.0;
    var sgx = 0.0;
    for (var i = lid; i < prm.H; i += WG) {
        let x = X[base + i];
        sxx = fma(x, x, sxx);
        sgx = fma(dY[base + i] * Wn[i], x, sgx);
    }
    let sums = workgroup_reduce(lid, vec2<f32>(sxx, sgx));
    let h = f32(prm.H);
    let rstd = 1.0 / sqrt(sums.x / h + prm.eps);
    let c = rstd * rstd * rstd * (sums.y / h);
    for (var i = lid; i < prm.H; i += WG) {
        var d = rstd * (dY[base + i] * Wn[i]) - X[base + i] * c;
        if (prm.accumulate != 0u) {
            d += dX[base + i];
        }
        dX[base + i] = d;
    }
}
