// Elementwise skeleton (as llama.cpp's glu_head/glu_main): a pure elementwise kernel is threads.wgsl, this file
// and its body file, which declares the op's storage bindings (@binding(1) on) and `fn op(i: u32)`, the work on
// element i. One thread per element over a 2-D grid of 256-thread workgroups (gpu/ops/common.py grid); the
// uniform block is (n, alpha, width). Bodies: add, add_inplace, add_bias, scale, glu_forward (swiglu_forward and
// geglu_forward), swiglu_backward, geglu_backward, adamw_update, to_bf16, from_bf16, lora_group_sum.

struct Params {
    n: u32,
    alpha: f32,   // scale only
    width: u32,   // add_bias only: the row length
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;

const WG: u32 = 256u;

fn n_items() -> u32 {
    return prm.n;
}

fn item(i: u32) {
    op(i);
}
