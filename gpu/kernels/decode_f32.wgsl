// F32 weight: W bound as array<vec4<f32>>; row n holds K floats (K % 4 == 0).
// decode4(n, k, K) = W[n, k..k+3] for k % 4 == 0 (shared contract of every decode_<type>.wgsl).
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    return W[(n * K + k) >> 2u];
}
