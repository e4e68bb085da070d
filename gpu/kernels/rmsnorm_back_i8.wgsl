// RMSNorm backward with the int8 codes of its result, the next integer GEMM's operand, in one pass over the row:
// dX[t] = rstd * (dY * w) - X * rstd^3 * mean(dY * w * X) (+ R[t] where prm.residual != 0) as
// rmsnorm_backward.wgsl gives it (bitwise: the same 64 invocations, element order and sum tree; its accumulation
// read from R instead of dX, so the residual stream's copy goes), and Q, S = the codes and scale of dX * CS (CS: the
// consuming projection's weight row scales, one a column) as quantize_i8.wgsl's scaled variant gives them
// (int8_codes.wgsl plain_codes_of_row; the values recomputed from dY, X, R). One workgroup per row
// (rows_rotated.wgsl). Both reductions share workgroup_reduce.wgsl's tree on triples: the two sums, then the absmax.
// ROT > 0: dY arrives rotated in blocks of ROT (dY R, the integer GEMMs' summed input gradient over rotated weight
// codes): the row is turned back first (hadamard.wgsl, as hadamard_rows.wgsl "back" does it: bitwise) into
// workgroup memory (rows of at most DYR values) and read from there; the codes are never rotated.

struct Params {
    T: u32,
    H: u32,
    eps: f32,
    residual: u32,   // != 0: dX = R + the norm's gradient
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> X: array<f32>;
@group(0) @binding(3) var<storage, read> Wn: array<f32>;
@group(0) @binding(4) var<storage, read> R: array<f32>;
@group(0) @binding(5) var<storage, read_write> dX: array<f32>;
@group(0) @binding(6) var<storage, read> CS: array<f32>;
@group(0) @binding(7) var<storage, read_write> Q: array<u32>;
@group(0) @binding(8) var<storage, read_write> S: array<f32>;

const WG: u32 = 64u;
var<workgroup> dyr: array<f32, ${DYR}>;   // ROT > 0: this row of dY turned back
alias Reduced = vec3<f32>;   // (sum of x^2, sum of g x, absmax)

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec3<f32>(a.x + b.x, a.y + b.y, max(a.z, b.z));
}

var<private> x_base: u32;   // this row's first element
var<private> rstd: f32;
var<private> c: f32;

// dY at column i of this row
fn dy_at(i: u32) -> f32 {
    if (ROT > 0u) {
        return dyr[i];
    }
    return dY[x_base + i];
}

// dyr <- this row of dY R^T (every invocation's groups lid + j WG, as hadamard_rows.wgsl rotates them)
fn turn_back_dy(lid: u32) {
    let units = prm.H / 4u;
    let shuffled = rotation_shuffled(lid, ROT / 4u);
    for (var j = 0u; j * WG < units; j++) {   // uniform (a block's ROT / 4 groups are all in or all out)
        let w = lid + j * WG;
        var x = vec4<f32>();
        if (w < units) {
            x = vec4<f32>(dY[x_base + 4u * w], dY[x_base + 4u * w + 1u], dY[x_base + 4u * w + 2u],
                          dY[x_base + 4u * w + 3u]);
        }
        var y: vec4<f32>;
        if (shuffled) {
            y = rotate_group_shuffled(lid, x, 4u * w, true);
        } else {
            y = rotate_group_shared(lid, x, 4u * w, true);
        }
        if (w < units) {
            dyr[4u * w] = y.x;
            dyr[4u * w + 1u] = y.y;
            dyr[4u * w + 2u] = y.z;
            dyr[4u * w + 3u] = y.w;
        }
    }
    workgroupBarrier();
}

// dX at column i of this row
fn grad(i: u32) -> f32 {
    var d = rstd * (dy_at(i) * Wn[i]) - X[x_base + i] * c;
    if (prm.residual != 0u) {
        d += R[x_base + i];
    }
    return d;
}

fn group4(w: u32) -> vec4<f32> {
    let k = 4u * w;
    return vec4<f32>(grad(k) * CS[k], grad(k + 1u) * CS[k + 1u], grad(k + 2u) * CS[k + 2u], grad(k + 3u) * CS[k + 3u]);
}

const ABSMAX: bool = true;
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, vec3<f32>(0.0, 0.0, m)).z / 127.0;
}

fn row_main(row: u32, lid: u32) {
    x_base = row * prm.H;
    if (ROT > 0u) {
        turn_back_dy(lid);
    }
    var sxx = 0.0;
    var sgx = 0.0;
    for (var i = lid; i < prm.H; i += WG) {   // the scalar rmsnorm_backward's order: element i, strided by WG
        let x = X[x_base + i];
        sxx = fma(x, x, sxx);
        sgx = fma(dy_at(i) * Wn[i], x, sgx);
    }
    let sums = workgroup_reduce(lid, vec3<f32>(sxx, sgx, 0.0));
    let h = f32(prm.H);
    rstd = 1.0 / sqrt(sums.x / h + prm.eps);
    c = rstd * rstd * rstd * (sums.y / h);
    workgroupBarrier();   // every invocation has read the sums before the absmax's reduction writes the tree again
    let scale = plain_codes_of_row(lid, prm.H / 4u, row * (prm.H / 4u));
    if (lid == 0u) {
        S[row] = scale;
    }
    for (var i = lid; i < prm.H; i += WG) {
        dX[x_base + i] = grad(i);
    }
}
