// Include: the power-of-two scale sigma of a small f32 tensor packed to f16, from the f32 bits of its max |x|
// (non-negative floats order like their bits, so an atomicMax of the bits finds it): sigma puts
// max |x| * sigma in [1/16, 1/8), so the f16 copy keeps its precision however small the values are
// (attention's dO, the KD head's dL/dlogits). The products computed from it are divided by the same sigma.
fn grad_scale(max_bits: u32) -> f32 {
    let e = clamp((max_bits >> 23u) & 0xffu, 1u, 249u);
    return bitcast<f32>((250u - e) << 23u);
}
