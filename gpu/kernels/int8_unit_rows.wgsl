// int8 codes of one rotated row held in registers as units of 16 (include after int8_units.wgsl): each unit read
// once by unit_values, rotated once, then its codes to Q[q0 + u]; returns the scale. The same codes and scale as
// int8_codes.wgsl's rotated_codes_of_row (the same butterflies in the same order; the absmax is exact), which reads
// and rotates each vec4 twice. The kernel defines WG, Q (array<vec4<u32>>), fn unit_values(u: u32) ->
// array<vec4<f32>, 4> (values 16 u .. 16 u + 15 of the row) and fn row_scale(lid: u32, m: f32) -> f32. col0: the
// row's first column (the rotation's signs). Call from uniform control flow.

fn rotated_unit_codes(lid: u32, units: u32, q0: u32, col0: u32) -> f32 {
    var v0: array<vec4<f32>, 4>;
    var v1: array<vec4<f32>, 4>;
    var v2: array<vec4<f32>, 4>;
    var v3: array<vec4<f32>, 4>;
    if (lid < units) {
        v0 = unit_values(lid);
    }
    if (lid + WG < units) {
        v1 = unit_values(lid + WG);
    }
    if (lid + 2u * WG < units) {
        v2 = unit_values(lid + 2u * WG);
    }
    if (lid + 3u * WG < units) {
        v3 = unit_values(lid + 3u * WG);
    }
    rotate_units(lid, units, col0, &v0, &v1, &v2, &v3);
    let scale = row_scale(lid, max(max(absmax16(v0), absmax16(v1)), max(absmax16(v2), absmax16(v3))));
    store_unit_codes(lid, units, q0, scale, v0, v1, v2, v3);
    return scale;
}

