// A gated unit's backward with the int8 codes of both its gradients, the gate and up projections' input-gradient
// operands, in one pass over the row: dG and dU as swiglu_backward.wgsl / geglu_backward.wgsl give them (bitwise;
// dG to DG, dU over U), and per gradient the codes and scale of dG * CG (CG: W_gate's row scales, one a column) and
// of dU * CU, as quantize_i8.wgsl's scaled variant gives them (int8_codes.wgsl codes_of_row, not rotated: the
// values recomputed from dY, G, U, which are overwritten only after both). Codes Q: dG's rows, then dU's from word
// prm.q1 (a row of F codes each); scales S: T for dG, then T for dU from prm.s1. One workgroup of WG invocations
// per row (rows_rotated.wgsl).

struct Params {
    T: u32,
    F: u32,    // row length, a multiple of 4
    q1: u32,   // dU's first code word in Q
    s1: u32,   // dU's first scale in S
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> dY: array<f32>;
@group(0) @binding(2) var<storage, read> G: array<f32>;
@group(0) @binding(3) var<storage, read_write> U: array<f32>;
@group(0) @binding(4) var<storage, read_write> DG: array<f32>;
@group(0) @binding(5) var<storage, read> CG: array<f32>;
@group(0) @binding(6) var<storage, read> CU: array<f32>;
@group(0) @binding(7) var<storage, read_write> Q: array<u32>;
@group(0) @binding(8) var<storage, read_write> S: array<f32>;

const WG: u32 = ${WG}u;
var<private> x_base: u32;   // this row's first element
var<private> which: u32;    // the gradient group4 gives: 0 dG * CG, 1 dU * CU

// (dG, dU) at element i
fn grads(i: u32) -> vec2<f32> {
${GRADS}
}

fn scaled(i: u32, c: u32) -> f32 {
    let d = grads(i);
    return select(d.x * CG[c], d.y * CU[c], which == 1u);
}

fn group4(w: u32) -> vec4<f32> {
    let c = 4u * w;
    let i = x_base + c;
    return vec4<f32>(scaled(i, c), scaled(i + 1u, c + 1u), scaled(i + 2u, c + 2u), scaled(i + 3u, c + 3u));
}

const ABSMAX: bool = true;
fn row_scale(lid: u32, m: f32) -> f32 {
    return workgroup_reduce(lid, m) / 127.0;
}

fn row_main(row: u32, lid: u32) {
    x_base = row * prm.F;
    let words = prm.F / 4u;
    which = 0u;
    let sg = codes_of_row(lid, words, row * words, 0u);
    workgroupBarrier();   // every invocation has read dG's scale before dU's reduction writes the tree again
    which = 1u;
    let su = codes_of_row(lid, words, prm.q1 + row * words, 0u);
    if (lid == 0u) {
        S[row] = sg;
        S[prm.s1 + row] = su;
    }
    storageBarrier();   // the row's dY, G, U were read for the codes before U is overwritten
    for (var c = lid; c < prm.F; c += WG) {
        let d = grads(x_base + c);
        DG[x_base + c] = d.x;
        U[x_base + c] = d.y;
    }
}
