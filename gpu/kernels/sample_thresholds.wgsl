// Sampled store, between the passes, one thread per row (threads.wgsl): from the pieces' (m_c, s_c) the row's max
// m, the CDF's piece bases Base[c] = sum_{c' < c} exp(m_c' - m) s_c' (in piece order; Base[n_pieces] = S) and the
// n thresholds t_i = (i + U_i) / n * S, U_i = (x_i >> 8) 2^-24 with x_i word i mod 4 of Philox block i / 4 under
// key (seed) and counter (pos, seq_id lo, seq_id hi, block) (model/sampled.py). A threshold that rounds up to S
// is set just below it (the reference's float64 never gets there): its draw is the last id with mass.

struct Params {
    T: u32,
    n_pieces: u32,
    n: u32,
    seed_lo: u32,
    seed_hi: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Stats: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read> Keys: array<vec4<u32>>;  // (pos, seq_id lo, seq_id hi, 0) per row
@group(0) @binding(3) var<storage, read_write> Base: array<f32>;   // [T, n_pieces + 1]
@group(0) @binding(4) var<storage, read_write> RowStat: array<vec2<f32>>;  // (m, S) per row
@group(0) @binding(5) var<storage, read_write> Thr: array<f32>;   // [T, n]

const WG: u32 = 64u;

fn n_items() -> u32 {
    return prm.T;
}

fn item(row: u32) {
    let np = prm.n_pieces;
    var m = -3.0e38;
    for (var c = 0u; c < np; c++) {
        m = max(m, Stats[row * np + c].x);
    }
    let bb = row * (np + 1u);
    var base = 0.0;
    Base[bb] = 0.0;
    for (var c = 0u; c < np; c++) {
        let st = Stats[row * np + c];
        let mass = exp(st.x - m) * st.y;
        base = base + mass;
        Base[bb + c + 1u] = base;
    }
    let total = base;
    RowStat[row] = vec2<f32>(m, total);
    let below = bitcast<f32>(bitcast<u32>(total) - 1u);  // total >= 1 (the max's own term)
    let key = Keys[row];
    var words = vec4<u32>(0u);
    for (var i = 0u; i < prm.n; i++) {
        if (i % 4u == 0u) {
            words = philox4x32(vec4<u32>(key.x, key.y, key.z, i / 4u), vec2<u32>(prm.seed_lo, prm.seed_hi));
        }
        let u = f32(words[i % 4u] >> 8u) * (1.0 / 16777216.0);
        let t = (f32(i) + u) / f32(prm.n) * total;
        Thr[row * prm.n + i] = min(t, below);
    }
}
