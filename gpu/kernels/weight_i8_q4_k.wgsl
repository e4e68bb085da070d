// weight_i8.wgsl for Q4_K weights, reading whole 16-byte pieces of the blocks: per row n, S[n] = max |W[n, :]| / 127
// and Q[n, k] = round(W[n, k] / S[n]) (ties to even, |q| <= 127), the same values and codes as weight_i8 with
// decode_q4_k.wgsl, from 2 vec4 loads per 16 weights instead of ~20 scalar ones.
// Q4_K: 256 weights in 144 bytes = 9 vec4 words: word 0 = d, dmin (f16) and scales[12] (8 x 6-bit scale + 6-bit
// min); words 1 .. 8 = qs[128]. Sub-block s (32 weights) has scale sc[s], min m[s]; weight j of sub-block s is the
// nibble (qs[32 (s / 2) + j] >> 4 (s % 2)) & 15; w = d sc[s] q - dmin m[s]. A unit is 16 weights (half a
// sub-block: one vec4 of qs). A workgroup per row; each invocation loads its PER units' pieces up front (all in
// flight at once: 4-11 % faster on an H100, 2026-12-06) and keeps them in registers between the
// absmax and the packing (a longer row decodes the rest twice), rotated first when ROT > 0 (hadamard.wgsl
// rotate_unit; ROT >= 16, rows of at most 4 WG units). FIXED_SCALE: S[n] holds the row's scale already (an earlier
// decode's): the codes alone, no absmax (the same codes).

struct Params {
    N: u32,   // rows
    K: u32,   // row length (multiple of 256)
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> Q: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> S: array<f32>;

const WG: u32 = ${WG}u;   // invocations a row (256, or 64 for rows of <= 4096: gpu/ops/quantize_i8.py)
const PER: u32 = 4u;
const FIXED_SCALE: bool = ${FIXED};

// byte i (0 .. 11) of a block's scales (bytes 4 .. 15 of its first word)
fn scale_byte(h: vec4<u32>, i: u32) -> u32 {
    let word = select(select(h.w, h.z, i < 8u), h.y, i < 4u);
    return (word >> ((i & 3u) * 8u)) & 0xFFu;
}

// the 16 weights of unit u of row n, as four vec4 (weights 16 h + 4 e .. of sub-block s)
fn unit_values(n: u32, u: u32) -> array<vec4<f32>, 4> {
    return unit_decoded(unit_words(n, u), u);
}

// the two 16-byte pieces unit u of row n decodes from: its block's first word (d, dmin, scales) and its qs
fn unit_words(n: u32, u: u32) -> array<vec4<u32>, 2> {
    let s = (u % 16u) / 2u;
    let blk = (n * (prm.K / 256u) + u / 16u) * 9u;
    return array<vec4<u32>, 2>(W[blk], W[blk + 1u + (s / 2u) * 2u + u % 2u]);
}

fn unit_decoded(words: array<vec4<u32>, 2>, u: u32) -> array<vec4<f32>, 4> {
    let s = (u % 16u) / 2u;
    let h = words[0];
    let dd = unpack2x16float(h.x);
    var sc: u32;
    var mn: u32;
    if (s < 4u) {
        sc = scale_byte(h, s) & 63u;
        mn = scale_byte(h, s + 4u) & 63u;
    } else {
        let md = scale_byte(h, s + 4u);
        sc = (md & 15u) | ((scale_byte(h, s - 4u) >> 6u) << 4u);
        mn = (md >> 4u) | ((scale_byte(h, s) >> 6u) << 4u);
    }
    let q = words[1];
    let sh = (s & 1u) * 4u;
    let a = dd.x * f32(sc);
    let c = vec4<f32>(dd.y * f32(mn));
    return array<vec4<f32>, 4>(a * nib4(q.x >> sh) - c, a * nib4(q.y >> sh) - c, a * nib4(q.z >> sh) - c,
                               a * nib4(q.w >> sh) - c);
}

fn nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u));
}


@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) sg: u32) {
    rot_subgroup = sg;
    let n = min(wid.x + wid.y * nwg.x, prm.N - 1u);   // extra workgroups of the grid redo the last row
    let units = prm.K / 16u;
    var v0: array<vec4<f32>, 4>;
    var v1: array<vec4<f32>, 4>;
    var v2: array<vec4<f32>, 4>;
    var v3: array<vec4<f32>, 4>;
    // the PER units' 16-byte pieces loaded up front (clamped inside the row), all in flight at once, then decoded
    let w0 = unit_words(n, min(lid, units - 1u));
    let w1 = unit_words(n, min(lid + WG, units - 1u));
    let w2 = unit_words(n, min(lid + 2u * WG, units - 1u));
    let w3 = unit_words(n, min(lid + 3u * WG, units - 1u));
    if (lid < units) {
        v0 = unit_decoded(w0, lid);
    }
    if (lid + WG < units) {
        v1 = unit_decoded(w1, lid + WG);
    }
    if (lid + 2u * WG < units) {
        v2 = unit_decoded(w2, lid + 2u * WG);
    }
    if (lid + 3u * WG < units) {
        v3 = unit_decoded(w3, lid + 3u * WG);
    }
    if (ROT > 0u) {   // rows of at most 4 WG units (the host's check): all in registers
        rotate_units(lid, units, 0u, &v0, &v1, &v2, &v3);
    }
    var scale: f32;
    if (FIXED_SCALE) {
        scale = S[n];
    } else {
        var m = max(max(absmax16(v0), absmax16(v1)), max(absmax16(v2), absmax16(v3)));
        for (var u = lid + PER * WG; u < units; u += WG) {
            m = max(m, absmax16(unit_values(n, u)));
        }
        scale = workgroup_reduce(lid, m) / 127.0;
    }
    let q0 = n * units;
    store_unit_codes(lid, units, q0, scale, v0, v1, v2, v3);
    for (var u = lid + PER * WG; u < units; u += WG) {
        Q[q0 + u] = pack16(unit_values(n, u), scale);
    }
    if (lid == 0u && !FIXED_SCALE) {
        S[n] = scale;
    }
}
