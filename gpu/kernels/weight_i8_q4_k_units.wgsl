// weight_i8.wgsl for Q4_K weights, reading whole 16-byte pieces of the blocks: per row n, S[n] = max |W[n, :]| / 127
// and Q[n, k] = round(W[n, k] / S[n]) (ties to even, |q| <= 127), the same values and codes as weight_i8 with
// decode_q4_k.wgsl, from 2 vec4 loads per 16 weights instead of ~20 scalar ones.
// Q4_K: 256 weights in 144 bytes = 9 vec4 words: word 0 = d, dmin (f16) and scales[12] (8 x 6-bit scale + 6-bit
// min); words 1 .. 8 = qs[128]. Sub-block s (32 weights) has scale sc[s], min m[s]; weight j of sub-block s is the
// nibble (qs[32 (s / 2) + j] >> 4 (s % 2)) & 15; w = d sc[s] q - dmin m[s]. A unit is 16 weights (half a
// sub-block: one vec4 of qs). A workgroup per row (weight_i8_q4_k.wgsl), or looping over rows with the next row's
// words loaded during this row's work (weight_i8_q4_k_loop.wgsl); each invocation keeps PER units in registers
// between the absmax and the packing (a longer row decodes the rest twice), rotated first when ROT > 0
// (hadamard.wgsl rotate_unit; ROT >= 16, rows of at most 4 WG units). FIXED_SCALE: S[n] holds the row's scale
// already (an earlier decode's): the codes alone, no absmax (the same codes). The kernel file after this one holds
// the entry point.

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

// the two words unit u of row n decodes from: its block's first word (d, dmin, scales) and its vec4 of qs
struct UnitWords {
    h: vec4<u32>,
    q: vec4<u32>,
};

fn unit_words(n: u32, u: u32) -> UnitWords {
    let s = (u % 16u) / 2u;
    let blk = (n * (prm.K / 256u) + u / 16u) * 9u;
    return UnitWords(W[blk], W[blk + 1u + (s / 2u) * 2u + u % 2u]);
}

// the 16 weights of unit u (of any row) from its words, as four vec4 (weights 16 h + 4 e .. of sub-block s)
fn unit_decode(w: UnitWords, u: u32) -> array<vec4<f32>, 4> {
    let s = (u % 16u) / 2u;
    let h = w.h;
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
    let q = w.q;
    let sh = (s & 1u) * 4u;
    let a = dd.x * f32(sc);
    let c = vec4<f32>(dd.y * f32(mn));
    return array<vec4<f32>, 4>(a * nib4(q.x >> sh) - c, a * nib4(q.y >> sh) - c, a * nib4(q.z >> sh) - c,
                               a * nib4(q.w >> sh) - c);
}

// the 16 weights of unit u of row n
fn unit_values(n: u32, u: u32) -> array<vec4<f32>, 4> {
    return unit_decode(unit_words(n, u), u);
}

fn nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(q, q >> 8u, q >> 16u, q >> 24u) & vec4<u32>(15u));
}
