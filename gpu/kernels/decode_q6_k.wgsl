// Q6_K: 256 weights in 210 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d f16.
// Weight j = 128 h + 64 s + b (b < 64) = 128 h + 32 t + c (c < 32):
// q = ((ql[64 h + b] >> 4 s) & 15) | (((qh[32 h + c] >> 2 t) & 3) << 4); w = d * scales[j / 16] * (q - 32).
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 256u) + k / 256u) * 210u;
    let j = k % 256u;
    let h = j / 128u;
    let jj = j % 128u;
    let lo = nib4(w_bytes4(base + h * 64u + jj % 64u) >> ((jj / 64u) * 4u));
    let qh = w_bytes4(base + 128u + h * 32u + jj % 32u) >> ((jj / 32u) * 2u);
    let hi = vec4<f32>(vec4<u32>(qh, qh >> 8u, qh >> 16u, qh >> 24u) & vec4<u32>(3u)) * 16.0;
    let sc = f32(bitcast<i32>(w_byte(base + 192u + j / 16u) << 24u) >> 24u);
    return (w_f16(base + 208u) * sc) * (lo + hi - vec4<f32>(32.0));
}
