// LoRA's products over the integer path's int8 codes (include after lora_paths_common.wgsl; gpu/ops/lora_matmul.py
// Codes): A(m, k) = code(m, k) * KS(k) with the sums of row m times RS(m), where each of RS and KS is unused, a
// factor or a divisor (prm.scaling: RS's use in bits 0-1, KS's in bits 2-3: 0 none, 1 times, 2 divided by, which
// gives 0 where the divisor is 0). KS scales S's row k as it is staged. Codes are signed bytes, four to a u32 word
// (little-endian); A's offsets and strides count words (lora_codes_across.wgsl) or vec4s of them (lora_codes_rows).
@group(0) @binding(4) var<storage, read> RS: array<f32>;
@group(0) @binding(5) var<storage, read> KS: array<f32>;

fn factor(x: f32, mode: u32) -> f32 {
    if (mode == 1u) {
        return x;
    }
    if (mode == 2u) {
        return select(0.0, 1.0 / x, x != 0.0);
    }
    return 1.0;
}

// KS's factor for reduction step k (1 past the end)
fn k_factor(k: u32) -> f32 {
    let mode = (prm.scaling >> 2u) & 3u;
    if (mode == 0u || k >= prm.K) {
        return 1.0;
    }
    return factor(KS[k], mode);
}

// RS's factor for output row m (1 past the end)
fn m_factor(m: u32) -> f32 {
    let mode = prm.scaling & 3u;
    if (mode == 0u || m >= prm.M) {
        return 1.0;
    }
    return factor(RS[m], mode);
}

// the four signed codes of word w (low byte first) as f32
fn codes4(w: u32) -> vec4<f32> {
    let v = bitcast<vec4<i32>>(vec4<u32>(w << 24u, w << 16u, w << 8u, w)) >> vec4<u32>(24u);
    return vec4<f32>(v);
}
