// RMSNorm forward with the int8 codes of its output, the integer GEMMs' A operand, in one pass over the row:
// Y[t] = X[t] * rstd * w (f32, bitwise rmsnorm_forward.wgsl's: the same 64 invocations and sum tree), and Q, S =
// Y's codes and scale as quantize_i8.wgsl gives them (rotated in blocks of ROT; int8_codes.wgsl codes_of_row, the
// values recomputed from X). One workgroup per row (rows_rotated.wgsl). Both reductions share
// workgroup_reduce.wgsl's tree on pairs: the sum of squares in x, the absmax in y. Rows of at most 4096 when rotated
// (the host's check).

// (Params, X, Wn, Y: rmsnorm_io.wgsl)
@group(0) @binding(4) var<storage, read_write> Q: array<u32>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;

var<private> x_base: u32;   // this row's first element of X and Y
var<private> rstd: f32;

fn group4(w: u32) -> vec4<f32> {
    let i = x_base + 4u * w;
    let k = 4u * w;
    let w4 = vec4<f32>(Wn[k], Wn[k + 1u], Wn[k + 2u], Wn[k + 3u]);
    return vec4<f32>(X[i], X[i + 1u], X[i + 2u], X[i + 3u]) * rstd * w4;
}

const ABSMAX: bool = true;   // (row_scale: rmsnorm_pairs.wgsl)

fn row_main(row: u32, lid: u32) {
    x_base = row * prm.H;
    rstd = row_rstd(lid, x_base);
    for (var w = lid; w < prm.H / 4u; w += WG) {
        let y = group4(w);
        for (var e = 0u; e < 4u; e++) {
            Y[x_base + 4u * w + e] = y[e];
        }
    }
    let scale = codes_of_row(lid, prm.H / 4u, x_base / 4u, 0u);
    if (lid == 0u) {
        S[row] = scale;
    }
}
