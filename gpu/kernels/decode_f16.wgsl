// F16 weight: 2 halves per u32 word; row n holds K halves (K % 4 == 0).
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let i = (n * K + k) >> 1u;
    return vec4<f32>(unpack2x16float(W[i]), unpack2x16float(W[i + 1u]));
}
