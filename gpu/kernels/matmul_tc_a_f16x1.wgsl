// A in f16 bound as array<u32> (2 halves a word; any lda, a_off). a_at: element i; a_vec4 / a_vec8:
// 4 / 8 elements from i, one at a time (no alignment assumed).
fn a_at(i: u32) -> f16 {
    return ${H2}(A[i >> 1u])[i & 1u];
}

fn a_vec4(i: u32) -> vec4<f16> {
    return vec4<f16>(a_at(i), a_at(i + 1u), a_at(i + 2u), a_at(i + 3u));
}

fn a_vec8(i: u32) -> H8 {
    return H8(a_vec4(i), a_vec4(i + 4u));
}
