// Shared byte access into a weight bound as `W: array<u32>` (raw GGUF block bytes, little-endian,
// padded with >= 4 zero bytes at the end). Every decode_<type>.wgsl snippet builds on these.

// 4 bytes starting at byte offset b (any alignment), little-endian.
fn w_bytes4(b: u32) -> u32 {
    let i = b >> 2u;
    let s = (b & 3u) * 8u;
    let lo = W[i];
    if (s == 0u) {
        return lo;
    }
    return (lo >> s) | (W[i + 1u] << (32u - s));
}

// One byte at byte offset b.
fn w_byte(b: u32) -> u32 {
    return (W[b >> 2u] >> ((b & 3u) * 8u)) & 0xFFu;
}

// One f16 at an even byte offset b, widened to f32.
fn w_f16(b: u32) -> f32 {
    return unpack2x16float(W[b >> 2u] >> ((b & 2u) * 8u)).x;
}

// Low nibbles of the 4 bytes of q, as floats (byte 0 first).
fn nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u));
}

// The 4 bytes of q as signed int8 values, as floats (byte 0 first).
fn i8x4(q: u32) -> vec4<f32> {
    let s = bitcast<i32>(q);
    return vec4<f32>(vec4<i32>(s << 24u, s << 16u, s << 8u, s) >> vec4<u32>(24u));
}
