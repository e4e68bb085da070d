// int8 codes of one rotated row held in registers as units of 16 consecutive values (include after int8_pack.wgsl
// and hadamard.wgsl; weight_i8_q4_k.wgsl's layout): unit u = lid + j WG, j < 4 (rows of at most 64 WG values, a
// multiple of ROT >= 16), each read once by unit_values, rotated once (hadamard.wgsl rotate_unit: the butterflies
// of h < 16 within an invocation, the rest by subgroup shuffles), then its codes to Q[q0 + u]; returns the scale. col0: the row's first column (the rotation's signs).
// The same codes and scale as int8_codes.wgsl's rotated_codes_of_row (the same butterflies in the same order; the
// absmax is exact), which reads and rotates each vec4 twice. The kernel defines WG, Q (array<vec4<u32>>),
// fn unit_values(u: u32) -> array<vec4<f32>, 4> (values 16 u .. 16 u + 15 of the row) and fn row_scale(lid: u32,
// m: f32) -> f32. Call from uniform control flow.

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
    let shuffled = rotation_shuffled(lid, ROT / 16u);
    rotate_unit(lid, &v0, col0 + 16u * lid, shuffled);   // units past the row are zeros in blocks of their own
    if (WG < units) {
        rotate_unit(lid, &v1, col0 + 16u * (lid + WG), shuffled);
    }
    if (2u * WG < units) {
        rotate_unit(lid, &v2, col0 + 16u * (lid + 2u * WG), shuffled);
    }
    if (3u * WG < units) {
        rotate_unit(lid, &v3, col0 + 16u * (lid + 3u * WG), shuffled);
    }
    let scale = row_scale(lid, max(max(absmax16(v0), absmax16(v1)), max(absmax16(v2), absmax16(v3))));
    if (lid < units) {
        Q[q0 + lid] = pack16(v0, scale);
    }
    if (lid + WG < units) {
        Q[q0 + lid + WG] = pack16(v1, scale);
    }
    if (lid + 2u * WG < units) {
        Q[q0 + lid + 2u * WG] = pack16(v2, scale);
    }
    if (lid + 3u * WG < units) {
        Q[q0 + lid + 3u * WG] = pack16(v3, scale);
    }
    return scale;
}
