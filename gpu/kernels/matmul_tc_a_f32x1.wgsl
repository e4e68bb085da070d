// A in f32 bound as array<f32> (any lda, a_off). a_at: element i as f16; a_vec4 / a_vec8: 4 / 8 elements.
fn a_at(i: u32) -> f16 {
    return f16(A[i]);
}

fn a_vec4(i: u32) -> vec4<f16> {
    return vec4<f16>(vec4<f32>(A[i], A[i + 1u], A[i + 2u], A[i + 3u]));
}

fn a_vec8(i: u32) -> H8 {
    return H8(a_vec4(i), a_vec4(i + 4u));
}
