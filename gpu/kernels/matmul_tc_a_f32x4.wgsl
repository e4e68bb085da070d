// A in f32 bound as array<vec4<f32>> (lda, a_off and the binding multiples of 4 elements).
// a_at: element i as f16; a_vec4 / a_vec8: 4 / 8 elements from i (i % 4 == 0).
fn a_at(i: u32) -> f16 {
    return f16(A[i >> 2u][i & 3u]);
}

fn a_vec4(i: u32) -> vec4<f16> {
    return vec4<f16>(A[i >> 2u]);
}

fn a_vec8(i: u32) -> H8 {
    return H8(vec4<f16>(A[i >> 2u]), vec4<f16>(A[(i >> 2u) + 1u]));
}
