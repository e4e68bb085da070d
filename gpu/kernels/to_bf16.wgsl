// Elementwise body (elementwise.wgsl), over n pairs: a bf16 copy two values per word, W[i] = bf16(X[2 i]) |
// bf16(X[2 i + 1]) << 16 (the top half of the f32 bits, rounded to nearest even; NaN stays NaN, found by its
// bits: no float compare). The tensor-core path's checkpointed block inputs (gpu/model.py): f32's range at half
// the bytes.

@group(0) @binding(1) var<storage, read> X: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> W: array<u32>;

fn bf16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return (b >> 16u) | 0x40u;   // a quiet NaN of the same sign
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;   // no wrap: the largest non-NaN word is 0xff800000
}

fn op(i: u32) {
    let v = X[i];
    W[i] = bf16_bits(v.x) | (bf16_bits(v.y) << 16u);
}
