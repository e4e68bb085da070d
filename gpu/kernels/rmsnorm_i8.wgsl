// RMSNorm forward with the int8 codes of its output, the integer GEMMs' A operand, in one pass over the row:
// Y[t] = X[t] * rstd * w (f32, bitwise rmsnorm_forward.wgsl's: the same 64 invocations and sum tree), and Q, S =
// Y's codes and scale as quantize_i8.wgsl gives them (rotated in blocks of ROT; int8_codes.wgsl codes_of_row, the
// values recomputed from X). One workgroup per row (2-D grid: wid.x + wid.y * nwg.x). Both reductions share
// workgroup_reduce.wgsl's tree on pairs: the sum of squares in x, the absmax in y. Rows of at most 4096 when rotated
// (the host's check).

struct Params {
    T: u32,
    H: u32,
    eps: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> Wn: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> Q: array<u32>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;

const WG: u32 = 64u;
alias Reduced = vec2<f32>;   // (sum of squares, absmax)

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec2<f32>(a.x + b.x, max(a.y, b.y));
}

var<private> x_base: u32;   // this row's first vec4 of X and Y
var<private> rstd: f32;

fn group4(w: u32) -> vec4<f32> {
    return X[x_base + w] * rstd * Wn[w];
}

const ABSMAX: bool = true;
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, vec2<f32>(0.0, m)).y / 127.0;
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    x_base = row * (prm.H / 4u);
    var s = 0.0;
    for (var i = lid; i < prm.H; i += WG) {   // rmsnorm_forward's order: element i, strided by WG
        let x = X[x_base + i / 4u][i % 4u];
        s = fma(x, x, s);
    }
    rstd = 1.0 / sqrt(workgroup_reduce(lid, vec2<f32>(s, 0.0)).x / f32(prm.H) + prm.eps);
    workgroupBarrier();   // every invocation has read the sum before the absmax's reduction writes the tree again
    for (var w = lid; w < prm.H / 4u; w += WG) {
        Y[x_base + w] = group4(w);
    }
    let scale = codes_of_row(lid, prm.H / 4u, x_base, 0u);
    if (lid == 0u) {
        S[row] = scale;
    }
}
