// KD head, pass 2, per vocab chunk: overwrite the recomputed chunk logits Z[t, 0..nv) with dL/dz:
//   dz = (scatter(DA[t], ids) - q_tau * sum(DA[t])) / tau + (ce_weight / n) (softmax(z) - onehot(target))
// with q_tau = exp(z / tau - lse_tau); zero on masked rows. One workgroup per row (rows.wgsl): the dense part over a
// strided set of columns, then (after a storage barrier) thread 0 adds the sparse terms id by id in order.

const CE: bool = ${CE};

struct Params {
    T: u32,
    nv: u32,
    ldz: u32,
    c0: u32,
    k: u32,
    inv_tau: f32,
    _pad0: u32,
    _pad1: u32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> DA: array<f32>;
@group(0) @binding(4) var<storage, read> RI: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> targets: array<u32>;
@group(0) @binding(6) var<storage, read_write> Z: array<f32>;

const WG: u32 = 64u;

fn row_main(row: u32, lid: u32) {
    let live = mask[row] != 0u;
    let ri = RI[row];
    let base = row * prm.ldz;
    let dense = ri.z * prm.inv_tau;
    for (var c = lid; c < prm.nv; c += WG) {
        let z = Z[base + c];
        var g = -exp(z * prm.inv_tau - ri.x) * dense;
        if (CE) {
            g += ri.w * exp(z - ri.y);
        }
        Z[base + c] = select(0.0, g, live);
    }
    storageBarrier();
    if (lid == 0u && live) {
        for (var j = 0u; j < prm.k; j++) {
            let id = ids[row * prm.k + j];
            if (id >= prm.c0 && id - prm.c0 < prm.nv) {
                let c = base + id - prm.c0;
                Z[c] = Z[c] + DA[row * prm.k + j] * prm.inv_tau;
            }
        }
        let tg = targets[row];
        if (CE && tg >= prm.c0 && tg - prm.c0 < prm.nv) {
            Z[base + tg - prm.c0] = Z[base + tg - prm.c0] - ri.w;
        }
    }
}
