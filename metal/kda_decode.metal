// kda_decode: Kimi Delta Attention, one decode token (or a few) for all heads in one
// dispatch, with the per-token preparation fused in: L2 norm of q and k (q also times
// `scale`), the lower-bound (or softplus) decay gate, beta = sigmoid(b), then the delta-rule
// state update and the output read, state in float32.
//
// Math: K31_SPEC.md section 3 "KDA"; Kimi Linear (arXiv 2510.26692); FLA
// `fla/ops/kda/naive.py` and `gate.py`. Reference op: kimi_mlx.metal.kda.kda_decode.
// Layout as mlx-lm's gated-delta kernel: the state is [B, H, Dv, Dk] (row dv holds the
// key channels), one SIMD-group per state row, lane owns key channels d = lane + 32*i.
//
// Inputs:   q, k [B, T, H, Dk] raw (after conv + SiLU); v [B, T, H, Dv];
//           a [B, T, H, Dk] raw gate (f_b(f_a(x))); b [B, T, H] beta logits;
//           A_log [H] float32; dt_bias [H * Dk] float32; state_in [B, H, Dv, Dk] float32;
//           scalars T (int), lower_bound, scale, eps (float).
// Outputs:  y [B, T, H, Dv] (OutT); state_out [B, H, Dv, Dk] float32.
// Template: OutT, Dk, Dv, H, GATE (0: g = lower_bound * sigmoid(e^A_log * (a + dt_bias));
//           1: g = -e^A_log * softplus(a + dt_bias)).
// Grid (32, Dv, B * H), threadgroup (32, R, 1): no barriers and no threadgroup memory, so
// any R and partial threadgroups are fine.

// @kernel kda_decode
constexpr int NL = (Dk + 31) / 32;  // key channels per lane
const uint lane = thread_index_in_simdgroup;
const uint n = thread_position_in_grid.z;  // b * H + h
const uint dv = thread_position_in_grid.y;
const uint bi = n / H;
const uint h = n % H;

const float a_scale = metal::exp(static_cast<float>(A_log[h]));
float st[NL];
float dtb[NL];
for (int i = 0; i < NL; ++i) {
  const uint d = lane + 32 * i;
  st[i] = 0.0f;
  dtb[i] = 0.0f;
  if (d < Dk) {
    st[i] = static_cast<float>(state_in[(n * Dv + dv) * Dk + d]);
    dtb[i] = static_cast<float>(dt_bias[h * Dk + d]);
  }
}

for (int t = 0; t < T; ++t) {
  const uint row = (bi * T + t) * H + h;  // (b, t, h)
  float qv[NL];
  float kv[NL];
  float dec[NL];
  float qq = 0.0f;
  float kk = 0.0f;
  for (int i = 0; i < NL; ++i) {
    const uint d = lane + 32 * i;
    qv[i] = 0.0f;
    kv[i] = 0.0f;
    dec[i] = 1.0f;
    if (d < Dk) {
      qv[i] = static_cast<float>(q[row * Dk + d]);
      kv[i] = static_cast<float>(k[row * Dk + d]);
      const float x = static_cast<float>(a[row * Dk + d]) + dtb[i];
      float g;
      if (GATE == 0) {
        g = lower_bound / (1.0f + metal::exp(-a_scale * x));
      } else {
        g = -a_scale * (metal::max(x, 0.0f) + metal::log(1.0f + metal::exp(-metal::abs(x))));
      }
      dec[i] = metal::exp(g);
    }
    qq += qv[i] * qv[i];
    kk += kv[i] * kv[i];
  }
  qq = simd_sum(qq);
  kk = simd_sum(kk);
  const float rq = metal::rsqrt(qq + eps) * scale;  // l2norm(q) * scale
  const float rk = metal::rsqrt(kk + eps);          // l2norm(k)
  const float beta = 1.0f / (1.0f + metal::exp(-static_cast<float>(b[row])));

  // S <- Diag(alpha) S;  mem = S^T k  (this row: sum_d S[dv, d] k[d])
  float mem = 0.0f;
  for (int i = 0; i < NL; ++i) {
    st[i] *= dec[i];
    mem += st[i] * kv[i];
  }
  mem = simd_sum(mem) * rk;
  const float delta = (static_cast<float>(v[row * Dv + dv]) - mem) * beta;

  // S <- S + beta k (v - S^T k)^T;  o = S^T q
  float out = 0.0f;
  for (int i = 0; i < NL; ++i) {
    st[i] += kv[i] * rk * delta;
    out += st[i] * qv[i];
  }
  out = simd_sum(out) * rq;
  if (lane == 0) {
    y[row * Dv + dv] = static_cast<OutT>(out);
  }
}

for (int i = 0; i < NL; ++i) {
  const uint d = lane + 32 * i;
  if (d < Dk) {
    state_out[(n * Dv + dv) * Dk + d] = st[i];
  }
}
