// Q8_0 (34-byte blocks of 32 weights, bound as array<u32>): w_vec8 = W[n, k..k+7] (k % 8 == 0) as f16
// from one load of d and the 8 int8 quants (w_bytes8: blocks are only 2-byte aligned). Branch-free.
// d * q is computed in f16: the exact product (11 x 8 bits) rounds once, as the f32 decode rounded to f16
// does.
fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    let b = (n * (K >> 5u) + (k >> 5u)) * 34u;  // byte offset of the block
    let d = f16(unpack2x16float(W[b >> 2u] >> ((b & 2u) * 8u)).x);
    let q = bitcast<vec2<i32>>(w_bytes8(b + 2u + (k & 31u)));
    let s = vec4<u32>(24u, 16u, 8u, 0u);
    let q0 = vec4<f16>((vec4<i32>(q.x) << s) >> vec4<u32>(24u));
    let q1 = vec4<f16>((vec4<i32>(q.y) << s) >> vec4<u32>(24u));
    return H8(d * q0, d * q1);
}
