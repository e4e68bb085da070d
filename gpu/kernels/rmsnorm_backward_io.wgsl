// RMSNorm backward (input gradient only; the weight is frozen), its parameters and bindings (include; ELEM: f32 for
// rmsnorm_backward.wgsl, vec4<f32> for rmsnorm_backward4.wgsl):
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
@group(0) @binding(1) var<storage, read> dY: array<${ELEM}>;
@group(0) @binding(2) var<storage, read> X: array<${ELEM}>;
@group(0) @binding(3) var<storage, read> Wn: array<${ELEM}>;
@group(0) @binding(4) var<storage, read_write> dX: array<${ELEM}>;
