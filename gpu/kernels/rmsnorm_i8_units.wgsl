// rmsnorm_i8.wgsl for rotated rows, held in registers as units of 16 (int8_unit_rows.wgsl; rows of at most 4096): the
// same Y (the sum of squares over X in rmsnorm_forward's order, then x * rstd * w), codes and scale, from one read
// of the row's units rotated once, where rmsnorm_i8.wgsl reads and rotates each vec4 twice. X is bound twice: as
// f32 for the sum's order, as vec4s for the units. One workgroup per row (rows_rotated.wgsl).

// (Params, X, Wn, Y: rmsnorm_io.wgsl, Wn and Y as vec4s)
@group(0) @binding(4) var<storage, read_write> Q: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;
@group(0) @binding(6) var<storage, read> X4: array<vec4<f32>>;

var<private> y_base: u32;   // this row's first vec4 of X and Y
var<private> rstd: f32;

// Y's unit u, as rmsnorm_i8's group4 computes each value, stored
fn unit_values(u: u32) -> array<vec4<f32>, 4> {
    let i = y_base + 4u * u;
    let k = 4u * u;
    return stored_unit(i, array<vec4<f32>, 4>(X4[i] * rstd * Wn[k], X4[i + 1u] * rstd * Wn[k + 1u],
                                              X4[i + 2u] * rstd * Wn[k + 2u], X4[i + 3u] * rstd * Wn[k + 3u]));
}


fn row_main(row: u32, lid: u32) {
    let base = row * prm.H;
    rstd = row_rstd(lid, base);
    y_base = base / 4u;
    let scale = rotated_unit_codes(lid, prm.H / 16u, base / 16u, 0u);
    if (lid == 0u) {
        S[row] = scale;
    }
}
