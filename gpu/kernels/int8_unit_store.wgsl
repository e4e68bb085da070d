// Y's unit of 16 values (include of rmsnorm_i8_units.wgsl and glu_i8_units.wgsl, whose Y is array<vec4<f32>>).
// unit v at vec4 i of Y, stored (unless prm.skip_y: uniform) and returned
fn stored_unit(i: u32, v: array<vec4<f32>, 4>) -> array<vec4<f32>, 4> {
    if (prm.skip_y == 0u) {
        Y[i] = v[0];
        Y[i + 1u] = v[1];
        Y[i + 2u] = v[2];
        Y[i + 3u] = v[3];
    }
    return v;
}
