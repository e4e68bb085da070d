// GELU in its tanh form (HF's gelu_pytorch_tanh, Gemma's gate), shared by geglu_forward and geglu_backward:
// gelu(g) = g/2 (1 + tanh(c (g + a g^3))), c = sqrt(2/pi), a = 0.044715 (model/reference.py _gelu_tanh).

const GELU_C: f32 = 0.7978845608028654;
const GELU_A: f32 = 0.044715;

// Overflow-safe tanh: (1 - e^-2|z|) / (1 + e^-2|z|) with the sign of z (no inf / inf for large |z|).
fn tanh_safe(z: f32) -> f32 {
    let e = exp(-2.0 * abs(z));
    let t = (1.0 - e) / (1.0 + e);
    return select(-t, t, z >= 0.0);
}

// (gelu(g), gelu'(g)).
fn gelu_tanh(g: f32) -> vec2<f32> {
    let th = tanh_safe(GELU_C * (g + GELU_A * g * g * g));
    let d = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * GELU_C * (1.0 + 3.0 * GELU_A * g * g);
    return vec2<f32>(0.5 * g * (1.0 + th), d);
}
