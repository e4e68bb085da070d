// Q4_0 (18-byte blocks of 32 weights, bound as array<u32>): w_vec8 = W[n, k..k+7] (k % 8 == 0) as f16
// from one load of d and the 8 quant bytes (w_bytes8: blocks are only 2-byte aligned). Branch-free.
// d * (q - 8) is computed in f16: the exact product (11 x 4 bits) rounds once, as the f32 decode rounded
// to f16 does.
fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    let b = (n * (K >> 5u) + (k >> 5u)) * 18u;  // byte offset of the block
    let j = k & 31u;
    let d = f16(unpack2x16float(W[b >> 2u] >> ((b & 2u) * 8u)).x);
    let q = w_bytes8(b + 2u + (j & 15u)) >> vec2<u32>((j >> 4u) * 4u);  // weights 16..31: high nibbles
    let m = vec4<u32>(15u);
    let q0 = vec4<f16>(vec4<u32>(q.x, q.x >> 8u, q.x >> 16u, q.x >> 24u) & m) - vec4<f16>(8.0h);
    let q1 = vec4<f16>(vec4<u32>(q.y, q.y >> 8u, q.y >> 16u, q.y >> 24u) & m) - vec4<f16>(8.0h);
    return H8(d * q0, d * q1);
}
