// Shared by the elementwise kernels (prepended by gpu/ops/add.py and gpu/ops/swiglu.py): one thread per element
// over a 2-D grid of 256-thread workgroups (gpu/ops/common.py grid), and the uniform block (n, alpha).

struct Params {
    n: u32,
    alpha: f32,   // used by scale only
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;

// The element this invocation handles (>= prm.n past the end).
fn element_index(wid: vec3<u32>, nwg: vec3<u32>, lid: u32) -> u32 {
    return (wid.x + wid.y * nwg.x) * 256u + lid;
}

// Overflow-safe logistic function.
fn sigmoid(x: f32) -> f32 {
    let e = exp(-abs(x));
    return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}
