// A gated unit's backward with the int8 codes of both its gradients, the gate and up projections' input-gradient
// operands, in one pass over the row: dG and dU as swiglu_backward.wgsl / geglu_backward.wgsl give them (bitwise;
// dG to DG, dU over U, unless prm.skip_grads: the caller reads the codes alone), and per gradient the codes and
// scale of dG * CG (CG: W_gate's row scales, one a column) and of dU * CU, as quantize_i8.wgsl's scaled variant
// gives them (bitwise; not rotated). Codes Q: dG's rows, then dU's from word prm.q1 (a row of F codes each);
// scales S: T for dG, then T for dU from prm.s1. One workgroup of WG invocations per row; each holds the pairs of
// vec4 w = lid + j WG (j < SLOTS) in registers from one read of dY, G and U to the codes, both absmaxes in one
// workgroup reduction (rows of at most 4 SLOTS WG values: the host's check).

struct Params {
    T: u32,
    F: u32,          // row length, a multiple of 4
    q1: u32,         // dU's first code word in Q
    s1: u32,         // dU's first scale in S
    skip_grads: u32, // 1 leaves DG and U as they were
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> dY: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> G: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> U: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> DG: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> CG: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> CU: array<vec4<f32>>;
@group(0) @binding(7) var<storage, read_write> Q: array<u32>;
@group(0) @binding(8) var<storage, read_write> S: array<f32>;

const WG: u32 = ${WG}u;

// both absmaxes in one tree (workgroup_reduce.wgsl)
alias Reduced = vec2<f32>;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return max(a, b);
}

// (dG, dU) of one element
fn grads(dy: f32, g: f32, u: f32) -> vec2<f32> {
${GRADS}
}

// one vec4 of the row: dG * CG and dU * CU
struct Pair {
    g: vec4<f32>,
    u: vec4<f32>,
};

// vec4 w of the row starting at vec4 x0: the gradients (stored unless prm.skip_grads), times the row scales
fn pair(x0: u32, w: u32) -> Pair {
    let i = x0 + w;
    let dy = dY[i];
    let g = G[i];
    let u = U[i];
    let e0 = grads(dy.x, g.x, u.x);
    let e1 = grads(dy.y, g.y, u.y);
    let e2 = grads(dy.z, g.z, u.z);
    let e3 = grads(dy.w, g.w, u.w);
    let dg = vec4<f32>(e0.x, e1.x, e2.x, e3.x);
    let du = vec4<f32>(e0.y, e1.y, e2.y, e3.y);
    if (prm.skip_grads == 0u) {
        DG[i] = dg;
        U[i] = du;
    }
    return Pair(dg * CG[w], du * CU[w]);
}

fn absmax2(p: Pair) -> vec2<f32> {
    return vec2<f32>(absmax4(p.g), absmax4(p.u));
}

// the codes of vec4 w (present) of the row: dG's at word qg + w, dU's at qu + w
fn store(p: Pair, w: u32, qg: u32, qu: u32, scale: vec2<f32>) {
    Q[qg + w] = pack4(p.g, scale.x);
    Q[qu + w] = pack4(p.u, scale.y);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let row = wid.x + wid.y * nwg.x;
    if (row >= prm.T) {
        return;
    }
    let n = prm.F / 4u;
    let x0 = row * n;
    var p0: Pair;
    var p1: Pair;
    var p2: Pair;
    var p3: Pair;
    var p4: Pair;
    var p5: Pair;
    var p6: Pair;
    var p7: Pair;
    if (lid < n) { p0 = pair(x0, lid); }
    if (lid + WG < n) { p1 = pair(x0, lid + WG); }
    if (lid + 2u * WG < n) { p2 = pair(x0, lid + 2u * WG); }
    if (lid + 3u * WG < n) { p3 = pair(x0, lid + 3u * WG); }
    if (lid + 4u * WG < n) { p4 = pair(x0, lid + 4u * WG); }
    if (lid + 5u * WG < n) { p5 = pair(x0, lid + 5u * WG); }
    if (lid + 6u * WG < n) { p6 = pair(x0, lid + 6u * WG); }
    if (lid + 7u * WG < n) { p7 = pair(x0, lid + 7u * WG); }
    let m = max(max(max(absmax2(p0), absmax2(p1)), max(absmax2(p2), absmax2(p3))),
                max(max(absmax2(p4), absmax2(p5)), max(absmax2(p6), absmax2(p7))));
    let scale = workgroup_reduce(lid, m) / 127.0;
    if (lid == 0u) {
        S[row] = scale.x;
        S[prm.s1 + row] = scale.y;
    }
    let qu = prm.q1 + x0;
    if (lid < n) { store(p0, lid, x0, qu, scale); }
    if (lid + WG < n) { store(p1, lid + WG, x0, qu, scale); }
    if (lid + 2u * WG < n) { store(p2, lid + 2u * WG, x0, qu, scale); }
    if (lid + 3u * WG < n) { store(p3, lid + 3u * WG, x0, qu, scale); }
    if (lid + 4u * WG < n) { store(p4, lid + 4u * WG, x0, qu, scale); }
    if (lid + 5u * WG < n) { store(p5, lid + 5u * WG, x0, qu, scale); }
    if (lid + 6u * WG < n) { store(p6, lid + 6u * WG, x0, qu, scale); }
    if (lid + 7u * WG < n) { store(p7, lid + 7u * WG, x0, qu, scale); }
}
