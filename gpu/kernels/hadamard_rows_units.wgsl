// hadamard_rows.wgsl over units of 16 (the units layout of int8_units.wgsl): Y[r, :] (+)= X[r, :] R^T, or (mode
// "forward") Y = X R, for rows of at most 64 WG values. Each invocation reads its units of the row (unit u = lid +
// j WG: four vec4s, all loads in flight at once), rotates each (hadamard.wgsl rotate_unit_to: the butterflies of
// h < 16 within the invocation, the rest by subgroup shuffles), and stores them: one read and one store of each
// value, where the vec4 kernel reads, rotates and stores one vec4 after the other. The same butterflies in the same
// order: bit for bit that kernel's result. In place (mode "back"): each invocation stores only what it read.

struct Params {
    T: u32,   // rows
    k: u32,   // row length, a multiple of ROT (>= 16)
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
${BINDINGS}

const WG: u32 = 256u;

fn load_unit(base: u32, u: u32) -> array<vec4<f32>, 4> {
    return array<vec4<f32>, 4>(X[base + 4u * u], X[base + 4u * u + 1u], X[base + 4u * u + 2u], X[base + 4u * u + 3u]);
}

fn store_unit(base: u32, u: u32, y: array<vec4<f32>, 4>) {
    for (var e = 0u; e < 4u; e++) {
        let w = base + 4u * u + e;
        ${STORE}
    }
}

fn row_main(r: u32, lid: u32) {
    let units = prm.k / 16u;
    let base = r * (prm.k / 4u);
    var v0: array<vec4<f32>, 4>;
    var v1: array<vec4<f32>, 4>;
    var v2: array<vec4<f32>, 4>;
    var v3: array<vec4<f32>, 4>;
    if (lid < units) {
        v0 = load_unit(base, lid);
    }
    if (lid + WG < units) {
        v1 = load_unit(base, lid + WG);
    }
    if (lid + 2u * WG < units) {
        v2 = load_unit(base, lid + 2u * WG);
    }
    if (lid + 3u * WG < units) {
        v3 = load_unit(base, lid + 3u * WG);
    }
    let shuffled = rotation_shuffled(lid, ROT / 16u);
    rotate_unit_to(lid, &v0, 16u * lid, shuffled, ${BACK});
    if (WG < units) {
        rotate_unit_to(lid, &v1, 16u * (lid + WG), shuffled, ${BACK});
    }
    if (2u * WG < units) {
        rotate_unit_to(lid, &v2, 16u * (lid + 2u * WG), shuffled, ${BACK});
    }
    if (3u * WG < units) {
        rotate_unit_to(lid, &v3, 16u * (lid + 3u * WG), shuffled, ${BACK});
    }
    if (lid < units) {
        store_unit(base, lid, v0);
    }
    if (lid + WG < units) {
        store_unit(base, lid + WG, v1);
    }
    if (lid + 2u * WG < units) {
        store_unit(base, lid + 2u * WG, v2);
    }
    if (lid + 3u * WG < units) {
        store_unit(base, lid + 3u * WG, v3);
    }
}
