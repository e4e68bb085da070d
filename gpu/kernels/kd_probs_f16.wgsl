// kd_stats.wgsl for the one-pass backward (gpu/ops/kd.py) on tensor cores: the chunk's probabilities against the
// row's running max at tau, P[t, c] = exp(z / tau - m_new) <= 1, as f16 times 2^15 (the product is scaled back by
// 2^-15: exact), two a word, columns nv .. ldz - 1 zero; F[t] = exp(m_old - m_new) rescales the sum over the
// earlier chunks (unused on the first chunk). Needs an even ldz.

const P_SCALE: f32 = 32768.0;

@group(0) @binding(1) var<storage, read> Z: array<f32>;
@group(0) @binding(6) var<storage, read_write> P: array<u32>;
@group(0) @binding(7) var<storage, read_write> F: array<f32>;

fn prob(base: u32, c: u32, m_new: f32) -> f32 {
    if (c >= prm.nv) {
        return 0.0;
    }
    return exp(Z[base + c] * prm.inv_tau - m_new) * P_SCALE;
}

fn emit_probs(row: u32, lid: u32, m_old: f32, m_new: f32) {
    let base = row * prm.ldz;
    let words = prm.ldz / 2u;
    for (var w = lid; w < words; w += WG) {
        let c = 2u * w;
        P[row * words + w] = pack2x16float(vec2<f32>(prob(base, c, m_new), prob(base, c + 1u, m_new)));
    }
    if (lid == 0u) {
        F[row] = select(exp(m_old - m_new), 0.0, prm.first != 0u);
    }
}
