// Q4_1: 32 weights in 20 bytes: d f16, m f16, qs[16]; w[j] = d * ((qs[j % 16] >> 4 * (j / 16)) & 15) + m.
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 32u) + k / 32u) * 20u;
    let j = k % 32u;
    let dm = unpack2x16float(W[base >> 2u]);
    let q = w_bytes4(base + 4u + (j & 15u)) >> ((j >> 4u) * 4u);
    return dm.x * nib4(q) + vec4<f32>(dm.y);
}
