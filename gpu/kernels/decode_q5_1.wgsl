// Q5_1: 32 weights in 24 bytes: d f16, m f16, qh u32 (bit j = 5th bit of weight j), qs[16] (low nibbles as
// Q4_0); w[j] = d * q[j] + m.
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 32u) + k / 32u) * 24u;
    let j = k % 32u;
    let dm = unpack2x16float(W[base >> 2u]);
    let hb = (W[(base >> 2u) + 1u] >> j) & 15u;
    let hi = vec4<f32>(vec4<u32>(hb, hb >> 1u, hb >> 2u, hb >> 3u) & vec4<u32>(1u)) * 16.0;
    let q = w_bytes4(base + 8u + (j & 15u)) >> ((j >> 4u) * 4u);
    return dm.x * (nib4(q) + hi) + vec4<f32>(dm.y);
}
