// kd_stats.wgsl as pass 1 of the two-pass backward, and in evaluation: Z read only, nothing emitted.

@group(0) @binding(1) var<storage, read> Z: array<f32>;

fn emit_probs(row: u32, lid: u32, m_old: f32, m_new: f32) {}
