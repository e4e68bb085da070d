// KD head, per row (after every chunk went through kd_stats): the loss and dL/da of model/kd.py, where
// a_j = log softmax(z / tau)[ids_j] = ZG[t, j] / tau - lse_tau. One thread per row; sums over the k ids run
// in ascending order. Variant constants: KIND (0 forward_kl, 1 reverse_kl, 2 jsd), TAIL (0: no tail entry;
// 1: the teacher's tail is 1 - sum exp(lt); 2: it is Tail[t]), CE (ce_weight > 0).
// n = RI[T].x, the number of unmasked rows (count_nonzero wrote it there). Writes RowLoss[t] = (tau^2 KD +
// ce_weight CE) / n (0 on masked rows), DA[t, j] = dL/da_j (already scaled by tau^2 / n) and
// RI[t] = (lse_tau, lse_1, sum_j DA[t, j], ce_weight / n) for kd_grad. 8 storage buffers (WebGPU's default
// limit): Tail is bound whatever TAIL is (to any buffer of T floats when it is not read).

const KIND: u32 = ${KIND}u;
const TAIL: u32 = ${TAIL}u;
const USE_TAIL: bool = TAIL != 0u;
const CE: bool = ${CE};
const EPS: f32 = 1e-12;
const LOG_EPS: f32 = -27.631021115928547;
const NEG_BIG: f32 = -3.0e38;

struct Params {
    T: u32,
    k: u32,
    tau: f32,
    inv_tau: f32,
    beta: f32,
    log_beta: f32,       // log(beta)
    log_1m_beta: f32,    // log(1 - beta)
    ce_weight: f32,
};

@group(0) @binding(0) var<uniform> prm: Params;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read> LT: array<f32>;
@group(0) @binding(3) var<storage, read> ZG: array<f32>;
@group(0) @binding(4) var<storage, read> S: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> RowLoss: array<f32>;
@group(0) @binding(6) var<storage, read_write> DA: array<f32>;
@group(0) @binding(7) var<storage, read_write> RI: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> Tail: array<f32>;

// 1 - exp(x) for x <= 0, accurate near 0 (= -expm1(x)).
fn one_minus_exp(x: f32) -> f32 {
    if (abs(x) < 1e-3) {
        return -x * (1.0 + x * (0.5 + x / 6.0));
    }
    return 1.0 - exp(x);
}

fn logaddexp(x: f32, y: f32) -> f32 {
    let m = max(x, y);
    return m + log(1.0 + exp(-abs(x - y)));
}

// Divergence term and its derivative d/d ls for one support entry (teacher lp, student ls).
fn div_term(lp: f32, ls: f32) -> vec2<f32> {
    let p = exp(lp);
    if (KIND == 0u) {
        return vec2<f32>(p * (lp - ls), -p);
    }
    let s = exp(ls);
    if (KIND == 1u) {
        return vec2<f32>(s * (ls - lp), s * (ls - lp + 1.0));
    }
    let b = prm.beta;
    let lm = logaddexp(prm.log_beta + lp, prm.log_1m_beta + ls);
    return vec2<f32>(b * p * (lp - lm) + (1.0 - b) * s * (ls - lm), (1.0 - b) * s * (ls - lm));
}

const WG: u32 = 64u;  // one thread per row (threads.wgsl)

fn n_items() -> u32 {
    return prm.T;
}

fn item(row: u32) {
    let k = prm.k;
    let lt0 = row * k;
    let zg0 = row * (k + 1u);
    if (mask[row] == 0u) {
        RowLoss[row] = 0.0;
        RI[row] = vec4<f32>(0.0);
        for (var j = 0u; j < k; j++) {
            DA[lt0 + j] = 0.0;
        }
        return;
    }
    let n = max(1.0, RI[prm.T].x);
    let st = S[row];
    let lse_t = st.x + log(st.y);
    let lse_1 = st.z + log(st.w);

    // teacher log-probs over the support: lp_j = max(lt_j - shift, LOG_EPS), tail entry lp_tail
    var shift = 0.0;
    var lp_tail = 0.0;
    var lt_max = NEG_BIG;
    for (var j = 0u; j < k; j++) {
        lt_max = max(lt_max, LT[lt0 + j]);
    }
    var lt_sum = 0.0;
    for (var j = 0u; j < k; j++) {
        lt_sum += exp(LT[lt0 + j] - lt_max);
    }
    let lse_lt = lt_max + log(lt_sum);
    if (USE_TAIL) {
        var tail: f32;
        if (TAIL == 2u) {
            tail = Tail[row];
        } else {
            tail = one_minus_exp(min(lse_lt, 0.0));
        }
        lp_tail = max(log(max(tail, EPS)), LOG_EPS);
    } else {
        shift = lse_lt;
    }

    // student: a_j = zg_j / tau - lse_t; ls_j = a_j - ls_shift; tail entry ls_tail
    var a_max = NEG_BIG;
    for (var j = 0u; j < k; j++) {
        a_max = max(a_max, ZG[zg0 + j] * prm.inv_tau - lse_t);
    }
    var a_sum = 0.0;
    for (var j = 0u; j < k; j++) {
        a_sum += exp(ZG[zg0 + j] * prm.inv_tau - lse_t - a_max);
    }
    let lse_a = a_max + log(a_sum);
    var ls_shift = 0.0;
    var q_tail = 0.0;
    var ls_tail = 0.0;
    if (USE_TAIL) {
        q_tail = one_minus_exp(min(lse_a, 0.0));
        ls_tail = log(max(q_tail, EPS));
    } else if (KIND != 0u) {
        ls_shift = lse_a;
    }

    // divergence and dL/d ls
    var kd = 0.0;
    var sum_dls = 0.0;
    for (var j = 0u; j < k; j++) {
        let lp = max(LT[lt0 + j] - shift, LOG_EPS);
        let ls = ZG[zg0 + j] * prm.inv_tau - lse_t - ls_shift;
        let td = div_term(lp, ls);
        kd += td.x;
        sum_dls += td.y;
    }
    var dlog_tail = 0.0;
    if (USE_TAIL) {
        let td = div_term(lp_tail, ls_tail);
        kd += td.x;
        if (q_tail > EPS) {
            dlog_tail = td.y / q_tail;
        }
    }
    let g = prm.tau * prm.tau / n;
    var sum_da = 0.0;
    for (var j = 0u; j < k; j++) {
        let lp = max(LT[lt0 + j] - shift, LOG_EPS);
        let a = ZG[zg0 + j] * prm.inv_tau - lse_t;
        let ls = a - ls_shift;
        var da = div_term(lp, ls).y;
        if (USE_TAIL) {
            da -= dlog_tail * exp(a);
        } else if (KIND != 0u) {
            da -= exp(ls) * sum_dls;
        }
        da *= g;
        DA[lt0 + j] = da;
        sum_da += da;
    }
    var loss = prm.tau * prm.tau * kd;
    var cw = 0.0;
    if (CE) {
        loss += prm.ce_weight * (lse_1 - ZG[zg0 + k]);
        cw = prm.ce_weight / n;
    }
    RowLoss[row] = loss / n;
    RI[row] = vec4<f32>(lse_t, lse_1, sum_da, cw);
}
