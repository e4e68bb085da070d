// Q6_K (210-byte blocks of 256 weights, bound as array<u32>): w_vec8 = W[n, k..k+7] (k % 8 == 0) as f16
// from the 8 low-nibble bytes, the 8 high-bit bytes (w_bytes8), one scale and d: the 8 weights share
// one 16-weight scale. Same f32 arithmetic as decode_q6_k.wgsl, rounded to f16.
fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    let base = (n * (K >> 8u) + (k >> 8u)) * 210u;
    let j = k & 255u;
    let h = j >> 7u;
    let jj = j & 127u;
    let lo = w_bytes8(base + h * 64u + (jj & 63u)) >> vec2<u32>((jj >> 6u) * 4u);
    let qh = w_bytes8(base + 128u + h * 32u + (jj & 31u)) >> vec2<u32>((jj >> 5u) * 2u);
    let sc = f32(bitcast<i32>(w_byte(base + 192u + (j >> 4u)) << 24u) >> 24u);
    let d = w_f16(base + 208u) * sc;
    let q = (lo & vec2<u32>(0x0F0F0F0Fu)) | ((qh & vec2<u32>(0x03030303u)) << vec2<u32>(4u));
    let m = vec4<u32>(255u);
    let q0 = vec4<f32>(vec4<u32>(q.x, q.x >> 8u, q.x >> 16u, q.x >> 24u) & m) - vec4<f32>(32.0);
    let q1 = vec4<f32>(vec4<u32>(q.y, q.y >> 8u, q.y >> 16u, q.y >> 24u) & m) - vec4<f32>(32.0);
    return H8(vec4<f16>(d * q0), vec4<f16>(d * q1));
}
