// rmsnorm_i8.wgsl for rotated rows, held in registers as units of 16 consecutive values (weight_i8_q4_k.wgsl's
// layout: unit u = lid + j WG, j < 4; ROT >= 16, rows of a multiple of ROT and at most 4 x 16 x WG = 4096 values):
// the same Y (the sum of squares over X in rmsnorm_forward's order, then x * rstd * w), codes and scale, from one
// read of the row's units, rotated once (hadamard.wgsl rotate_unit: the butterflies of h < 16 within an
// invocation, the rest by subgroup shuffles) where rmsnorm_i8.wgsl reads and rotates each vec4 twice. X is bound
// twice: as f32 for the sum's order, as vec4s for the units. One workgroup per row (rows_rotated.wgsl).

struct Params {
    T: u32,
    H: u32,
    eps: f32,
    _pad: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> X: array<f32>;
@group(0) @binding(2) var<storage, read> Wn: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> Q: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> S: array<f32>;
@group(0) @binding(6) var<storage, read> X4: array<vec4<f32>>;

const WG: u32 = 64u;
alias Reduced = vec2<f32>;   // (sum of squares, absmax)

fn combine(a: Reduced, b: Reduced) -> Reduced {
    return vec2<f32>(a.x + b.x, max(a.y, b.y));
}

// Y's unit u of the row starting at vec4 b (stored), as rmsnorm_i8's group4 computes each value
fn unit_y(b: u32, u: u32, rstd: f32) -> array<vec4<f32>, 4> {
    let i = b + 4u * u;
    let k = 4u * u;
    let v = array<vec4<f32>, 4>(X4[i] * rstd * Wn[k], X4[i + 1u] * rstd * Wn[k + 1u], X4[i + 2u] * rstd * Wn[k + 2u],
                                X4[i + 3u] * rstd * Wn[k + 3u]);
    Y[i] = v[0];
    Y[i + 1u] = v[1];
    Y[i + 2u] = v[2];
    Y[i + 3u] = v[3];
    return v;
}

fn row_main(row: u32, lid: u32) {
    let base = row * prm.H;
    var s = 0.0;
    for (var i = lid; i < prm.H; i += WG) {   // rmsnorm_forward's order: element i, strided by WG
        let x = X[base + i];
        s = fma(x, x, s);
    }
    let rstd = 1.0 / sqrt(workgroup_reduce(lid, vec2<f32>(s, 0.0)).x / f32(prm.H) + prm.eps);
    workgroupBarrier();   // every invocation has read the sum before the absmax's reduction writes the tree again
    let units = prm.H / 16u;
    let b = base / 4u;
    var v0: array<vec4<f32>, 4>;
    var v1: array<vec4<f32>, 4>;
    var v2: array<vec4<f32>, 4>;
    var v3: array<vec4<f32>, 4>;
    if (lid < units) {
        v0 = unit_y(b, lid, rstd);
    }
    if (lid + WG < units) {
        v1 = unit_y(b, lid + WG, rstd);
    }
    if (lid + 2u * WG < units) {
        v2 = unit_y(b, lid + 2u * WG, rstd);
    }
    if (lid + 3u * WG < units) {
        v3 = unit_y(b, lid + 3u * WG, rstd);
    }
    let shuffled = rotation_shuffled(lid, ROT / 16u);
    rotate_unit(lid, &v0, 16u * lid, shuffled);   // units past the row are zeros in blocks of their own
    if (WG < units) {
        rotate_unit(lid, &v1, 16u * (lid + WG), shuffled);
    }
    if (2u * WG < units) {
        rotate_unit(lid, &v2, 16u * (lid + 2u * WG), shuffled);
    }
    if (3u * WG < units) {
        rotate_unit(lid, &v3, 16u * (lid + 3u * WG), shuffled);
    }
    let m = max(max(absmax16(v0), absmax16(v1)), max(absmax16(v2), absmax16(v3)));
    let scale = workgroup_reduce(lid, vec2<f32>(0.0, m)).y / 127.0;
    let q0 = row * units;
    if (lid < units) {
        Q[q0 + lid] = pack16(v0, scale);
    }
    if (lid + WG < units) {
        Q[q0 + lid + WG] = pack16(v1, scale);
    }
    if (lid + 2u * WG < units) {
        Q[q0 + lid + 2u * WG] = pack16(v2, scale);
    }
    if (lid + 3u * WG < units) {
        Q[q0 + lid + 3u * WG] = pack16(v3, scale);
    }
    if (lid == 0u) {
        S[row] = scale;
    }
}
