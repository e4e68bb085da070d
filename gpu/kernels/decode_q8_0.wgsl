// Q8_0: 32 weights in 34 bytes: d f16, qs[32] int8; w[j] = d * qs[j].
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 32u) + k / 32u) * 34u;
    let d = w_f16(base);
    return d * i8x4(w_bytes4(base + 2u + k % 32u));
}
