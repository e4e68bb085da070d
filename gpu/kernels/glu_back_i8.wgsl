// A gated unit's backward with the int8 codes of both its gradients, the gate and up projections' input-gradient
// operands, in one pass over the row: dG and dU as swiglu_backward.wgsl / geglu_backward.wgsl give them (bitwise;
// dG to DG, dU over U, unless prm.skip_grads: the caller reads the codes alone), and per gradient the codes and
// scale of dG * CG (CG: W_gate's row scales, one a column) and of dU * CU, as quantize_i8.wgsl's scaled variant
// gives them (bitwise; not rotated); dY may come rotated (ROT > 0), turned back as hadamard_rows.wgsl's "back"
// does. Codes Q: dG's rows, then dU's from word prm.q1 (a row of F codes each); scales S: T for dG, then T for dU
// from prm.s1. One workgroup of WG invocations per row (rows_rotated.wgsl); each holds the pairs of vec4
// w = lid + j WG (j < 8) in registers from one read of dY, G and U to the codes, both absmaxes in one workgroup
// reduction (rows of at most 32 WG values: the host's check).

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

// vec4 w of the row starting at vec4 x0 (a row of n; past it: zeros, nothing stored): the gradients (stored unless
// prm.skip_grads), times the row scales. dY rotated (ROT > 0: dY R, the down projection's input gradient over
// rotated codes) is turned back as it is read (hadamard.wgsl; every invocation calls this with the same slot, from
// uniform control flow)
fn pair(lid: u32, x0: u32, w: u32, n: u32, shuffled: bool) -> Pair {
    let present = w < n;
    let c = min(w, n - 1u);
    let i = x0 + c;
    var dy = select(vec4<f32>(), dY[i], present);
    if (ROT > 0u) {
        if (shuffled) {
            dy = rotate_group_shuffled(lid, dy, 4u * w, true);
        } else {
            dy = rotate_group_shared(lid, dy, 4u * w, true);
        }
    }
    let g = G[i];
    let u = U[i];
    let e0 = grads(dy.x, g.x, u.x);
    let e1 = grads(dy.y, g.y, u.y);
    let e2 = grads(dy.z, g.z, u.z);
    let e3 = grads(dy.w, g.w, u.w);
    let dg = vec4<f32>(e0.x, e1.x, e2.x, e3.x);
    let du = vec4<f32>(e0.y, e1.y, e2.y, e3.y);
    if (present && prm.skip_grads == 0u) {
        DG[i] = dg;
        U[i] = du;
    }
    return Pair(select(vec4<f32>(), dg * CG[c], present), select(vec4<f32>(), du * CU[c], present));
}

fn absmax2(p: Pair) -> vec2<f32> {
    return vec2<f32>(absmax4(p.g), absmax4(p.u));
}

// the codes of vec4 w of the row (where present): dG's at word qg + w, dU's at qu + w
fn store(p: Pair, w: u32, n: u32, qg: u32, qu: u32, scale: vec2<f32>) {
    if (w < n) {
        Q[qg + w] = pack4(p.g, scale.x);
        Q[qu + w] = pack4(p.u, scale.y);
    }
}

fn row_main(row: u32, lid: u32) {
    let n = prm.F / 4u;
    let x0 = row * n;
    var shuffled = false;
    if (ROT > 0u) {
        shuffled = rotation_shuffled(lid, ROT / 4u);
    }
    var p0: Pair;
    var p1: Pair;
    var p2: Pair;
    var p3: Pair;
    var p4: Pair;
    var p5: Pair;
    var p6: Pair;
    var p7: Pair;
    p0 = pair(lid, x0, lid, n, shuffled);   // slot j where j WG < n (uniform)
    if (WG < n) { p1 = pair(lid, x0, lid + WG, n, shuffled); }
    if (2u * WG < n) { p2 = pair(lid, x0, lid + 2u * WG, n, shuffled); }
    if (3u * WG < n) { p3 = pair(lid, x0, lid + 3u * WG, n, shuffled); }
    if (4u * WG < n) { p4 = pair(lid, x0, lid + 4u * WG, n, shuffled); }
    if (5u * WG < n) { p5 = pair(lid, x0, lid + 5u * WG, n, shuffled); }
    if (6u * WG < n) { p6 = pair(lid, x0, lid + 6u * WG, n, shuffled); }
    if (7u * WG < n) { p7 = pair(lid, x0, lid + 7u * WG, n, shuffled); }
    let m = max(max(max(absmax2(p0), absmax2(p1)), max(absmax2(p2), absmax2(p3))),
                max(max(absmax2(p4), absmax2(p5)), max(absmax2(p6), absmax2(p7))));
    let scale = workgroup_reduce(lid, m) / 127.0;
    if (lid == 0u) {
        S[row] = scale.x;
        S[prm.s1 + row] = scale.y;
    }
    let qu = prm.q1 + x0;
    store(p0, lid, n, x0, qu, scale);
    store(p1, lid + WG, n, x0, qu, scale);
    store(p2, lid + 2u * WG, n, x0, qu, scale);
    store(p3, lid + 3u * WG, n, x0, qu, scale);
    store(p4, lid + 4u * WG, n, x0, qu, scale);
    store(p5, lid + 5u * WG, n, x0, qu, scale);
    store(p6, lid + 6u * WG, n, x0, qu, scale);
    store(p7, lid + 7u * WG, n, x0, qu, scale);
}
