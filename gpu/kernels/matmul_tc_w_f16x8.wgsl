// F16 weight bound as array<vec4<u32>> (8 halves per element; K % 8 == 0): decode4 for the checked
// loaders and w_vec8 = W[n, k..k+7] (k % 8 == 0) as f16 without a round trip through f32.
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let i = n * K + k;
    let q = W[i >> 3u];
    let h = select(q.xy, q.zw, (i & 4u) != 0u);
    return vec4<f32>(unpack2x16float(h.x), unpack2x16float(h.y));
}

fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    let q = W[(n * K + k) >> 3u];
    return H8(${H4}(q.xy), ${H4}(q.zw));
}
