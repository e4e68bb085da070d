// RMSNorm backward over rows of H = 4 n values read as vec4s (rmsnorm_backward_io.wgsl): each of the WG threads
// keeps up to PER of its row's vec4s of X and g = dY * w in registers between the two sums and the output (a
// longer row reads the rest twice), so the row is read once.

const WG: u32 = 256u;
const PER: u32 = 4u;
alias Reduced = vec2<f32>;

fn row_main(row: u32, lid: u32) {
    let n = prm.H / 4u;
    let base = row * n;
    var x: array<vec4<f32>, PER>;
    var g: array<vec4<f32>, PER>;
    var sxx = vec4<f32>(0.0);
    var sgx = vec4<f32>(0.0);
    for (var p = 0u; p < PER; p++) {   // unrolled: the registers' loads all in flight
        let i = lid + p * WG;
        if (i < n) {
            x[p] = X[base + i];
            g[p] = dY[base + i] * Wn[i];
            sxx = fma(x[p], x[p], sxx);
            sgx = fma(g[p], x[p], sgx);
        }
    }
    for (var i = lid + PER * WG; i < n; i += WG) {
        let xi = X[base + i];
        sxx = fma(xi, xi, sxx);
        sgx = fma(dY[base + i] * Wn[i], xi, sgx);
    }
    let one = vec4<f32>(1.0);
    let sums = workgroup_reduce(lid, vec2<f32>(dot(sxx, one), dot(sgx, one)));
    let h = f32(prm.H);
    let rstd = 1.0 / sqrt(sums.x / h + prm.eps);
    let c = rstd * rstd * rstd * (sums.y / h);
    for (var p = 0u; p < PER; p++) {
        let i = lid + p * WG;
        if (i < n) {
            var d = rstd * g[p] - x[p] * c;
            if (prm.accumulate != 0u) {
                d += dX[base + i];
            }
            dX[base + i] = d;
        }
    }
    for (var i = lid + PER * WG; i < n; i += WG) {
        var d = rstd * (dY[base + i] * Wn[i]) - X[base + i] * c;
        if (prm.accumulate != 0u) {
            d += dX[base + i];
        }
        dX[base + i] = d;
    }
}
