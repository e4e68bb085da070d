// Sampled store, last pass, one thread per row (threads.wgsl): the ascending draws as model/sampled.py's encode
// stores them: the distinct ids first, their counts and log-prob codes min(255, round(-16 log p)), log p = z / tau -
// m - log S, then padding (id 0, count 0, code 0).

struct Params {
    T: u32,
    n: u32,
    _p0: u32,
    _p1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> Draws: array<u32>;
@group(0) @binding(2) var<storage, read> ZV: array<f32>;
@group(0) @binding(3) var<storage, read> RowStat: array<vec2<f32>>;
@group(0) @binding(4) var<storage, read_write> OutIds: array<u32>;
@group(0) @binding(5) var<storage, read_write> OutCounts: array<u32>;
@group(0) @binding(6) var<storage, read_write> OutCodes: array<u32>;

const WG: u32 = 64u;

fn n_items() -> u32 {
    return prm.T;
}

fn item(row: u32) {
    let n = prm.n;
    let rs = RowStat[row];
    let log_s = log(rs.y);
    let b = row * n;
    var k = 0u;
    var prev = 0u;
    for (var i = 0u; i < n; i++) {
        let v = Draws[b + i];
        if (i == 0u || v != prev) {
            let lp = (ZV[b + i] - rs.x) - log_s;
            OutIds[b + k] = v;
            OutCounts[b + k] = 1u;
            OutCodes[b + k] = u32(clamp(round(-16.0 * lp), 0.0, 255.0));
            k++;
            prev = v;
        } else {
            OutCounts[b + k - 1u] += 1u;
        }
    }
    for (var i = k; i < n; i++) {
        OutIds[b + i] = 0u;
        OutCounts[b + i] = 0u;
        OutCodes[b + i] = 0u;
    }
}
