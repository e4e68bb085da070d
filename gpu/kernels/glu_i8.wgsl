// A gated unit's forward with the int8 codes of its output, the down projection's A operand, in one pass over the
// row: Y = act(G) * U (f32, bitwise glu_forward.wgsl's: act(g) = ${GATE}), and Q, S = Y's codes and scale as
// quantize_i8.wgsl gives them (rotated in blocks of ROT; int8_codes.wgsl codes_of_row, the values recomputed from G
// and U). One workgroup of WG invocations per row (rows_rotated.wgsl); rotated rows of at most
// 16 WG groups of four (the host's check).

struct Params {
    T: u32,
    F: u32,   // row length, a multiple of 4
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> G: array<f32>;
@group(0) @binding(2) var<storage, read> U: array<f32>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> Q: array<u32>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;

const WG: u32 = ${WG}u;
var<private> x_base: u32;   // this row's first element

fn value(i: u32) -> f32 {
    let g = G[i];
    return ${GATE} * U[i];
}

fn group4(w: u32) -> vec4<f32> {
    let i = x_base + 4u * w;
    return vec4<f32>(value(i), value(i + 1u), value(i + 2u), value(i + 3u));
}

const ABSMAX: bool = true;
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, m) / 127.0;
}

fn row_main(row: u32, lid: u32) {
    x_base = row * prm.F;
    for (var w = lid; w < prm.F / 4u; w += WG) {
        Y[x_base / 4u + w] = group4(w);
    }
    let scale = codes_of_row(lid, prm.F / 4u, x_base / 4u, 0u);
    if (lid == 0u) {
        S[row] = scale;
    }
}
