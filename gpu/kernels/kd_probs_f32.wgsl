// kd_stats.wgsl for the one-pass backward (gpu/ops/kd.py), f32: after the gathers have read it, the chunk's logits
// become P[t, c] = exp(z / tau - m_new) in place (m_new: the row's running max at tau, this chunk included), and
// F[t] = exp(m_old - m_new) rescales the sum over the earlier chunks (unused on the first chunk).

@group(0) @binding(1) var<storage, read_write> Z: array<f32>;
@group(0) @binding(6) var<storage, read_write> F: array<f32>;

fn emit_probs(row: u32, lid: u32, m_old: f32, m_new: f32) {
    storageBarrier();  // every gather of this row has read Z
    let base = row * prm.ldz;
    for (var c = lid; c < prm.nv; c += WG) {
        Z[base + c] = exp(Z[base + c] * prm.inv_tau - m_new);
    }
    if (lid == 0u) {
        F[row] = select(exp(m_old - m_new), 0.0, prm.first != 0u);
    }
}
