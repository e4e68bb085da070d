// Q4_K: 256 weights in 144 bytes: d f16, dmin f16, scales[12] (8 x 6-bit scale + 6-bit min), qs[128].
// Sub-block s (32 weights) has scale sc[s], min m[s]; weight j of sub-block s is the nibble
// (qs[32 * (s / 2) + j] >> 4 * (s % 2)) & 15; w = d * sc[s] * q - dmin * m[s].
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let base = (n * (K / 256u) + k / 256u) * 144u;
    let j = k % 256u;
    let s = j / 32u;
    let dd = unpack2x16float(W[base >> 2u]);
    var sc: u32;
    var mn: u32;
    if (s < 4u) {
        sc = w_byte(base + 4u + s) & 63u;
        mn = w_byte(base + 8u + s) & 63u;
    } else {
        let md = w_byte(base + 8u + s);
        sc = (md & 15u) | ((w_byte(base + s) >> 6u) << 4u);
        mn = (md >> 4u) | ((w_byte(base + 4u + s) >> 6u) << 4u);
    }
    let q = w_bytes4(base + 16u + (s / 2u) * 32u + j % 32u) >> ((s & 1u) * 4u);
    return (dd.x * f32(sc)) * nib4(q) - vec4<f32>(dd.y * f32(mn));
}
