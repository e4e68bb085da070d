// Q4_K weight bound as array<vec4<u32>>: a 144-byte block of 256 weights is 9 vectors — [0] d, dmin and
// the 12 bytes of packed 6-bit scales / mins, [1 + 2 * (s / 2) ..] the 32 quant bytes of sub-blocks s, s + 1
// (low / high nibbles). One 16-byte load decodes a sub-block's scale and min, a second one holds the
// nibbles of 16 consecutive weights. Branch-free: the units of one subgroup may span several sub-blocks
// ("nn"). w = d * sc[s] * q - dmin * m[s] in f32, rounded to f16 (as the generic decode4).

// (d * sc[s], dmin * m[s]) of sub-block s from the block's header vector h
fn q4k_scale_min(h: vec4<u32>, s: u32) -> vec2<f32> {
    let dd = unpack2x16float(h.x);
    let t = (s & 3u) * 8u;
    let b1 = (h.y >> t) & 255u;  // scales[s % 4]
    let b2 = (h.z >> t) & 255u;  // scales[4 + s % 4]
    let b3 = (h.w >> t) & 255u;  // scales[8 + s % 4]
    let upper = s >= 4u;
    let sc = select(b1 & 63u, (b3 & 15u) | ((b1 >> 6u) << 4u), upper);
    let mn = select(b2 & 63u, (b3 >> 4u) | ((b2 >> 6u) << 4u), upper);
    return vec2<f32>(dd.x * f32(sc), dd.y * f32(mn));
}

// the nibbles of the 4 bytes of q, as floats (byte 0 first)
fn q4k_nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u));
}

// W[n, k..k+3] (k % 4 == 0) as f32: the checked loaders
fn decode4(n: u32, k: u32, K: u32) -> vec4<f32> {
    let blk = (n * (K >> 8u) + (k >> 8u)) * 9u;
    let j = k & 255u;
    let s = j >> 5u;
    let sm = q4k_scale_min(W[blk], s);
    let q = W[blk + 1u + (s >> 1u) * 2u + ((j & 31u) >> 4u)][(j >> 2u) & 3u] >> ((s & 1u) * 4u);
    return sm.x * q4k_nib4(q) - vec4<f32>(sm.y);
}

// W[n, k..k+7] (k % 8 == 0) as f16
fn w_vec8(n: u32, k: u32, K: u32) -> H8 {
    let blk = (n * (K >> 8u) + (k >> 8u)) * 9u;
    let j = k & 255u;
    let s = j >> 5u;
    let sm = q4k_scale_min(W[blk], s);
    let qv = W[blk + 1u + (s >> 1u) * 2u + ((j & 31u) >> 4u)];
    let q = select(qv.xy, qv.zw, (j & 8u) != 0u) >> vec2<u32>((s & 1u) * 4u);
    let off = vec4<f32>(sm.y);
    return H8(vec4<f16>(sm.x * q4k_nib4(q.x) - off), vec4<f16>(sm.x * q4k_nib4(q.y) - off));
}
