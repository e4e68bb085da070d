// Q4_0: 32 weights in 18 bytes: d f16, qs[16]; w[j] = d * ((qs[j % 16] >> 4 * (j / 16)) & 15) - 8).
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 32u) + k / 32u) * 18u;
    let j = k % 32u;
    let d = w_f16(base);
    let q = w_bytes4(base + 2u + (j & 15u)) >> ((j >> 4u) * 4u);
    return d * (nib4(q) - vec4<f32>(8.0));
}
