// weight_i8_q4_k looping over rows (after weight_i8_q4_k_units.wgsl): workgroup g decodes rows g, g + G, g + 2 G, ..
// (G workgroups in the grid), each invocation's words of the next row loaded before this row's decode, rotation,
// scale and stores, so the loads are in flight behind them (one row a workgroup leaves each invocation's loads
// exposed, and a row's work between them). The same codes and scales as weight_i8_q4_k.wgsl.

// invocation lid's words of row n: unit lid + j WG's in w_j where that unit exists (left as they were else)
fn row_words(n: u32, lid: u32, units: u32, w0: ptr<function, UnitWords>, w1: ptr<function, UnitWords>,
             w2: ptr<function, UnitWords>, w3: ptr<function, UnitWords>) {
    if (lid < units) {
        *w0 = unit_words(n, lid);
    }
    if (lid + WG < units) {
        *w1 = unit_words(n, lid + WG);
    }
    if (lid + 2u * WG < units) {
        *w2 = unit_words(n, lid + 2u * WG);
    }
    if (lid + 3u * WG < units) {
        *w3 = unit_words(n, lid + 3u * WG);
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let units = prm.K / 16u;
    let stride = nwg.x * nwg.y;
    var n = wid.x + wid.y * nwg.x;   // uniform: the loop's barriers (rotation, row max) see every invocation
    var w0: UnitWords;
    var w1: UnitWords;
    var w2: UnitWords;
    var w3: UnitWords;
    if (n < prm.N) {
        row_words(n, lid, units, &w0, &w1, &w2, &w3);
    }
    while (n < prm.N) {
        var v0: array<vec4<f32>, 4>;
        var v1: array<vec4<f32>, 4>;
        var v2: array<vec4<f32>, 4>;
        var v3: array<vec4<f32>, 4>;
        if (lid < units) {
            v0 = unit_decode(w0, lid);
        }
        if (lid + WG < units) {
            v1 = unit_decode(w1, lid + WG);
        }
        if (lid + 2u * WG < units) {
            v2 = unit_decode(w2, lid + 2u * WG);
        }
        if (lid + 3u * WG < units) {
            v3 = unit_decode(w3, lid + 3u * WG);
        }
        let next = n + stride;
        if (next < prm.N) {
            row_words(next, lid, units, &w0, &w1, &w2, &w3);   // in flight during this row's work
        }
        if (ROT > 0u) {
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
            workgroupBarrier();   // every invocation has read red[0] before the next row's reduction writes it
        }
        let q0 = n * units;
        store_unit_codes(lid, units, q0, scale, v0, v1, v2, v3);
        for (var u = lid + PER * WG; u < units; u += WG) {
            Q[q0 + u] = pack16(unit_values(n, u), scale);
        }
        if (lid == 0u && !FIXED_SCALE) {
            S[n] = scale;
        }
        n = next;
    }
}
