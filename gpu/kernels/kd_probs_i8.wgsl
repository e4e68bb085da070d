// kd_stats.wgsl for the one-pass backward on the integer GEMM (gpu/ops/kd.py, Int8Head probs): the chunk's
// probabilities against the row's running max at tau times the chunk's W row scales, P'[t, c] = exp(z / tau -
// m_new) * SW[c], as int8 codes of their row's scale SA[t] = max_c P'[t, c] / 127, rounded stochastically:
// code = min(floor(P' / SA + u), 127), u uniform in [0, 1) from a hash of (seed, row, vocab id), so that the codes
// are unbiased (E[code SA] = P'). Rounding to nearest instead keeps the few top entries and drops the rest of the
// softmax's mass (docs/benchmarks.md: the held-out KL +274 % on the demo; stochastic +0.6 .. 0.8 %). Then
// P' . codes(W R) = (P W) R, the sum of W's rows the backward needs, on the integer GEMM ("nn"). The codes go to
// PQ as rows of nv codes (four a word, little-endian), the scales to PQ's words from prm's scales offset; F[t] =
// exp(m_old - m_new) rescales the sum over the earlier chunks (unused on the first chunk). model/int8.py
// stochastic_probs_i8 is the numpy twin (the same hash and arithmetic).

@group(0) @binding(1) var<storage, read> Z: array<f32>;
@group(0) @binding(6) var<storage, read_write> PQ: array<u32>;
@group(0) @binding(7) var<storage, read_write> F: array<f32>;
@group(0) @binding(8) var<storage, read> SW: array<f32>;
@group(0) @binding(9) var<uniform> dither: vec4<u32>;   // (seed, scales offset in words of PQ, -, -)

var<workgroup> row_max: array<f32, WG>;

// the low-bias 32-bit integer hash (lowbias32); model/int8.py's twin
fn mix32(v: u32) -> u32 {
    var x = v;
    x ^= x >> 16u;
    x *= 0x7FEB352Du;
    x ^= x >> 15u;
    x *= 0x846CA68Bu;
    x ^= x >> 16u;
    return x;
}

// u in [0, 1) for vocab id `id` of row `row` (24 bits)
fn dither_at(row: u32, id: u32) -> f32 {
    let h = mix32(dither.x ^ mix32((row * 0x9E3779B1u) ^ mix32(id)));
    return f32(h >> 8u) * (1.0 / 16777216.0);
}

fn scaled_prob(base: u32, c: u32, m_new: f32) -> f32 {
    return exp(Z[base + c] * prm.inv_tau - m_new) * SW[c];
}

fn emit_probs(row: u32, lid: u32, m_old: f32, m_new: f32) {
    let base = row * prm.ldz;
    var mx = 0.0;
    for (var c = lid; c < prm.nv; c += WG) {
        mx = max(mx, scaled_prob(base, c, m_new));
    }
    row_max[lid] = mx;
    workgroupBarrier();
    for (var w = WG / 2u; w > 0u; w >>= 1u) {
        if (lid < w) {
            row_max[lid] = max(row_max[lid], row_max[lid + w]);
        }
        workgroupBarrier();
    }
    let scale = row_max[0] / 127.0;
    let words = prm.nv / 4u;
    for (var w = lid; w < words; w += WG) {
        var word = 0u;
        for (var e = 0u; e < 4u; e++) {
            let c = 4u * w + e;
            var q = 0.0;
            if (scale > 0.0) {
                q = min(floor(scaled_prob(base, c, m_new) / scale + dither_at(row, prm.c0 + c)), 127.0);
            }
            word |= u32(q) << (8u * e);
        }
        PQ[row * words + w] = word;
    }
    if (lid == 0u) {
        F[row] = select(exp(m_old - m_new), 0.0, prm.first != 0u);
        PQ[dither.y + row] = bitcast<u32>(scale);
    }
}
