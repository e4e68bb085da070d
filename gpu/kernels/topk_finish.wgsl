// Teacher top-k, final pass per row: log-probs at temperature tau of the kept ids,
//   LP[t, j] = Vals[t, j] / tau - lse(z / tau),  Tail[t] = max(0, 1 - sum_j exp(LP[t, j]))  (j ascending).

struct Params {
    T: u32,
    k: u32,
    inv_tau: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Vals: array<f32>;
@group(0) @binding(2) var<storage, read> S: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> LP: array<f32>;
@group(0) @binding(4) var<storage, read_write> Tail: array<f32>;

const WG: u32 = 64u;  // one thread per row (threads.wgsl)

fn n_items() -> u32 {
    return prm.T;
}

fn item(row: u32) {
    let st = S[row];
    let lse = st.x + log(st.y);
    var mass = 0.0;
    for (var j = 0u; j < prm.k; j++) {
        let lp = Vals[row * prm.k + j] * prm.inv_tau - lse;
        LP[row * prm.k + j] = lp;
        mass += exp(lp);
    }
    Tail[row] = max(0.0, 1.0 - mass);
}
