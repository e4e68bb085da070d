// RMSNorm backward (input gradient only; the weight is frozen):
//   g = dY * w, dX = rstd * g - X * rstd^3 * mean(g * X)   (= rstd * (g - xhat * mean(g * xhat)))
// One workgroup per row (rows.wgsl); both sums in one fixed-order tree (workgroup_reduce.wgsl on (sum x^2, sum g x)).
// accumulate != 0: dX += instead of dX =.

struct Params {
    T: u32,
    H: u32,
    eps: f32,
    accumulate: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read> Wn: array<f32>;
@group(0) @binding(4) var<storage, read_write> dX: array<f32>;

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
