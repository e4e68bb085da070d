// RMSNorm backward (input gradient only; the weight is frozen):
//   g = dY * w, dX = rstd * g - X * rstd^3 * mean(g * X)   (= rstd * (g - xhat * mean(g * xhat)))
// One workgroup per row, two fixed-order tree reductions. accumulate != 0: dX += instead of dX =.

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
var<workgroup> red_xx: array<f32, WG>;
var<workgroup> red_gx: array<f32, WG>;

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    let base = row * prm.H;
    var sxx = 0.0;
    var sgx = 0.0;
    for (var i = lid; i < prm.H; i += WG) {
        let x = X[base + i];
        sxx = fma(x, x, sxx);
        sgx = fma(dY[base + i] * Wn[i], x, sgx);
    }
    red_xx[lid] = sxx;
    red_gx[lid] = sgx;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if (lid < w) {
            red_xx[lid] += red_xx[lid + w];
            red_gx[lid] += red_gx[lid + w];
        }
        workgroupBarrier();
    }
    let h = f32(prm.H);
    let rstd = 1.0 / sqrt(red_xx[0] / h + prm.eps);
    let c = rstd * rstd * rstd * (red_gx[0] / h);
    for (var i = lid; i < prm.H; i += WG) {
        var d = rstd * (dY[base + i] * Wn[i]) - X[base + i] * c;
        if (prm.accumulate != 0u) {
            d += dX[base + i];
        }
        dX[base + i] = d;
    }
}
