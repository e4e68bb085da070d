// weight_i8_q4_k: one workgroup a row (after weight_i8_q4_k_units.wgsl)
@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let n = min(wid.x + wid.y * nwg.x, prm.N - 1u);   // extra workgroups of the grid redo the last row
    let units = prm.K / 16u;
    var v0: array<vec4<f32>, 4>;
    var v1: array<vec4<f32>, 4>;
    var v2: array<vec4<f32>, 4>;
    var v3: array<vec4<f32>, 4>;
    if (lid < units) {
        v0 = unit_values(n, lid);
    }
    if (lid + WG < units) {
        v1 = unit_values(n, lid + WG);
    }
    if (lid + 2u * WG < units) {
        v2 = unit_values(n, lid + 2u * WG);
    }
    if (lid + 3u * WG < units) {
        v3 = unit_values(n, lid + 3u * WG);
    }
    if (ROT > 0u) {   // rows of at most 4 WG units (the host's check): all in registers
        rotate_units(lid, units, 0u, &v0, &v1, &v2, &v3);
    }
    var scale: f32;
    if (FIXED_SCALE) {
        scale = S[n];
    } else {
        var m = max(max(absmax16(v0), absmax16(v1)), max(absmax16(v2), absmax16(v3)));
        for (var u = lid + PER * WG; u < units; u += WG) {
            m = max(m, absmax16(unit_values(n, u)));
        }
        scale = workgroup_reduce(lid, m) / 127.0;
    }
    let q0 = n * units;
    store_unit_codes(lid, units, q0, scale, v0, v1, v2, v3);
    for (var u = lid + PER * WG; u < units; u += WG) {
        Q[q0 + u] = pack16(unit_values(n, u), scale);
    }
    if (lid == 0u && !FIXED_SCALE) {
        S[n] = scale;
    }
}
