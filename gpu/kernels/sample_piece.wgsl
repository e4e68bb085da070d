// Sampled store, one piece (<= PIECE columns) of a row's logits in workgroup memory (include of sample_stats and
// sample_draw, one workgroup per row: rows.wgsl). e_j = exp(z_j / tau - m_c) with m_c the piece's max; thread w
// owns the contiguous segment j in [w L, (w + 1) L) (L = ceil(nv / WG)), summed in id order; Incl[w] = Incl[w - 1]
// + (segment w's sum), accumulated by one thread in segment order. So a CDF value inside segment w is
// Incl[w - 1] + (its running segment sum), the same f32 additions that give Incl[w] at the segment's end: the
// piece's CDF is monotone and ends exactly at Incl[WG - 1], the piece's sum, on every run and batching.

// both passes' parameters and logits (their own bindings follow from 2)
struct Params {
    T: u32,
    nv: u32,        // piece columns (<= PIECE)
    ldz: u32,       // row stride of Z
    z_off: u32,     // column of the piece's first logit inside a row of Z
    v0: u32,        // vocab id of that column
    piece: u32,     // index of the piece in the row
    n_pieces: u32,
    n: u32,         // draws per position
    inv_tau: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Z: array<f32>;

const WG: u32 = 256u;
const PIECE: u32 = 4096u;
const NEG_BIG: f32 = -3.0e38;

var<workgroup> E: array<f32, PIECE>;
var<workgroup> Incl: array<f32, WG>;

alias Reduced = f32;

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return max(a, b);
}

// E[j] = z_j / tau of the row's piece; returns this thread's max of them.
fn piece_load(row: u32, lid: u32) -> f32 {
    let zb = row * prm.ldz + prm.z_off;
    var mx = NEG_BIG;
    for (var j = lid; j < prm.nv; j += WG) {
        let x = Z[zb + j] * prm.inv_tau;
        E[j] = x;
        mx = max(mx, x);
    }
    return mx;
}

// This thread's segment [a, b) of the piece.
fn segment(lid: u32) -> vec2<u32> {
    let len = (prm.nv + WG - 1u) / WG;
    let a = min(lid * len, prm.nv);
    return vec2<u32>(a, min(a + len, prm.nv));
}

// E[j] = exp(E[j] - mc) and Incl (the segments' inclusive prefix sums); call after piece_load, uniformly.
fn piece_scan(lid: u32, mc: f32) {
    for (var j = lid; j < prm.nv; j += WG) {
        E[j] = exp(E[j] - mc);
    }
    workgroupBarrier();
    let seg = segment(lid);
    var acc = 0.0;
    for (var j = seg.x; j < seg.y; j++) {
        acc += E[j];
    }
    Incl[lid] = acc;
    workgroupBarrier();
    if (lid == 0u) {
        var run = Incl[0];
        for (var w = 1u; w < WG; w++) {
            run = run + Incl[w];
            Incl[w] = run;
        }
    }
    workgroupBarrier();
}
