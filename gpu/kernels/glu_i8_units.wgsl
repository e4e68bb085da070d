// glu_i8.wgsl for rotated rows, held in registers as units of 16 (int8_unit_rows.wgsl; rows of at most 64 WG values):
// the same Y = act(G) * U (bitwise glu_forward.wgsl's: act(g) = ${GATE}), codes and scale, from one read of G and U
// as vec4s, each unit rotated once, where glu_i8.wgsl reads and rotates each vec4 twice. One workgroup of WG
// invocations per row (rows_rotated.wgsl).

struct Params {
    T: u32,
    F: u32,   // row length, a multiple of ROT
    skip_y: u32,  // 1 leaves Y unwritten (the caller needs the codes alone)
    _pad0: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> G: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> U: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> Q: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;

const WG: u32 = ${WG}u;
var<private> y_base: u32;   // this row's first vec4

fn value(g: f32, up: f32) -> f32 {
    return ${GATE} * up;
}

fn value4(i: u32) -> vec4<f32> {
    let g = G[i];
    let u = U[i];
    return vec4<f32>(value(g.x, u.x), value(g.y, u.y), value(g.z, u.z), value(g.w, u.w));
}

// Y's unit u, stored
fn unit_values(u: u32) -> array<vec4<f32>, 4> {
    let i = y_base + 4u * u;
    return stored_unit(i, array<vec4<f32>, 4>(value4(i), value4(i + 1u), value4(i + 2u), value4(i + 3u)));
}

fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, m) / 127.0;
}

fn row_main(row: u32, lid: u32) {
    y_base = row * prm.F / 4u;
    let scale = rotated_unit_codes(lid, prm.F / 16u, row * prm.F / 16u, 0u);
    if (lid == 0u) {
        S[row] = scale;
    }
}
