// KD head, one-pass backward, last (gpu/ops/kd.py): kd_grad.wgsl's dz . W regrouped. The chunks left
// U[t, :] = sum_v exp(z_v / tau - m_tau) W[v, :] in Y (m_tau = S[t].x, the row's max at tau); this turns it into
//   dh[t, :] = coef U[t, :] + sum_j DA[t, j] / tau W[ids[t, j], :] - ce_n W[target[t], :]    (unmasked rows; else 0)
// with coef = -sum(DA[t]) / tau exp(m_tau - lse_tau) (+ ce_n exp(m_tau - lse_1): CE, only at tau = 1, where the
// two softmaxes are one), RI[t] = (lse_tau, lse_1, sum DA, ce_n) from kd_row.wgsl. The rows of W at the ids are
// decoded in-kernel from its GGML type (as embedding.wgsl). One thread per 4 consecutive outputs (row_vec4.wgsl).

${DECODE}

const CE: bool = ${CE};

struct Params {
    T: u32,
    H: u32,   // row length (multiple of 4 and of the type's block)
    k: u32,   // teacher ids per row
    inv_tau: f32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> W: array<${W_ELEM}>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read> DA: array<f32>;
@group(0) @binding(4) var<storage, read> RI: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> S: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read> targets: array<u32>;
@group(0) @binding(7) var<storage, read> mask: array<u32>;
@group(0) @binding(8) var<storage, read_write> Y: array<vec4<f32>>;

fn out4(t: u32, col: u32, i: u32) {
    if (mask[t] == 0u) {
        Y[i] = vec4<f32>(0.0);
        return;
    }
    let ri = RI[t];
    let m = S[t].x;
    var coef = -ri.z * prm.inv_tau * exp(m - ri.x);
    if (CE) {
        coef += ri.w * exp(m - ri.y);
    }
    var acc = coef * Y[i];
    for (var j = 0u; j < prm.k; j++) {
        acc += (DA[t * prm.k + j] * prm.inv_tau) * decode4(ids[t * prm.k + j], col, prm.H);
    }
    if (CE) {
        acc -= ri.w * decode4(targets[t], col, prm.H);
    }
    Y[i] = acc;
}
