// kda_prefill: chunked Kimi Delta Attention for prompts of any length, carrying the
// float32 state across chunks (WY / UT form with the intra-chunk triangular solve).
//
// Math: Kimi Linear (arXiv 2510.26692) section 3, FLA `chunk_kda` / `naive_chunk_kda`;
// reference ops kimi_mlx.metal.kda.kda_chunked (same chunk algebra) and kda_recurrent.
// Per chunk of C tokens, with G the within-chunk cumulative log decay (G_C its last row)
// and S0 the incoming state column for one value channel j:
//     A[i,m] = beta_i sum_d k_i k_m e^{G_i-G_m}   (m < i)      Tinv = (I + A)^-1
//     u      = Tinv (beta (v_j - (k e^G) S0))
//     o_t    = (q_t e^{G_t}) S0 + sum_{i<=t} M[t,i] u_i,  M[t,i] = sum_d q_t k_i e^{G_t-G_i}
//     S      = e^{G_C} S0 + sum_i (k_i e^{G_C-G_i}) u_i
// Value channels are independent given (q, k, g, beta), so threadgroups split Dv; every
// threadgroup rebuilds the chunk's A, Tinv and M (cheap next to the state work).
// e^{G_i-G_m} is computed directly (never as a product of e^{G_i} and e^{-G_m}), so there
// is no overflow for any gate; e^{G_t} alone may underflow to 0, which is its true limit.
//
// Inputs:   q, k [B, T, H, Dk] (L2-normalised, q scaled); v [B, T, H, Dv];
//           g [B, T, H, Dk] float32 log decay; beta [B, T, H]; state_in [B, H, Dv, Dk]
//           float32; scalar T (int).
// Outputs:  y [B, T, H, Dv] (OutT); state_out [B, H, Dv, Dk] float32.
// Template: OutT, Dk, Dv, H, C (chunk, <= 32), NSG (SIMD-groups per threadgroup),
//           CPS (value columns per SIMD-group).
// Grid (32, NSG * nblk, B * H), threadgroup (32, NSG, 1), nblk = ceil(Dv / (NSG * CPS)).
// Threadgroup memory: 4 * (3 * C * Dk + 3 * C * C + Dk + C) bytes (27.6 KiB at C=16, Dk=128).

// @kernel kda_prefill
constexpr int NL = (Dk + 31) / 32;  // key channels per lane
constexpr uint NT = 32 * NSG;        // threads per threadgroup
const uint lane = thread_index_in_simdgroup;
const uint sgi = simdgroup_index_in_threadgroup;
const uint tid = thread_index_in_threadgroup;
const uint n = threadgroup_position_in_grid.z;  // b * H + h
const uint bi = n / H;
const uint h = n % H;
const uint col0 = (threadgroup_position_in_grid.y * NSG + sgi) * CPS;

threadgroup float sq[C][Dk];   // q, then q e^G
threadgroup float sk[C][Dk];   // k, then k e^G
threadgroup float sgc[C][Dk];  // g, then G (cumulative), then k e^{G_C - G}
threadgroup float sA[C][C];
threadgroup float sM[C][C];
threadgroup float sT[C][C];
threadgroup float send[Dk];    // e^{G_C}
threadgroup float sbeta[C];

float st[CPS][NL];  // state columns j = col0 + c, key channels d = lane + 32 * i
for (int c = 0; c < CPS; ++c) {
  const uint j = col0 + c;
  for (int i = 0; i < NL; ++i) {
    const uint d = lane + 32 * i;
    st[c][i] = (j < Dv && d < Dk) ? static_cast<float>(state_in[(n * Dv + j) * Dk + d]) : 0.0f;
  }
}

for (int t0 = 0; t0 < T; t0 += C) {
  // 1. Load the chunk; tokens past T are zeros (no decay, no update, no output).
  for (uint e = tid; e < C * Dk; e += NT) {
    const uint t = e / Dk;
    const uint d = e % Dk;
    const int tok = t0 + int(t);
    float qx = 0.0f, kx = 0.0f, gx = 0.0f;
    if (tok < T) {
      const uint off = ((bi * T + tok) * H + h) * Dk + d;
      qx = static_cast<float>(q[off]);
      kx = static_cast<float>(k[off]);
      gx = static_cast<float>(g[off]);
    }
    sq[t][d] = qx;
    sk[t][d] = kx;
    sgc[t][d] = gx;
  }
  for (uint t = tid; t < C; t += NT) {
    const int tok = t0 + int(t);
    sbeta[t] = tok < T ? static_cast<float>(beta[(bi * T + tok) * H + h]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. G = cumulative sum of g over the chunk, per key channel.
  for (uint d = tid; d < Dk; d += NT) {
    float acc = 0.0f;
    for (int t = 0; t < C; ++t) {
      acc += sgc[t][d];
      sgc[t][d] = acc;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. A (strictly lower) and M (lower with diagonal): one SIMD-group per (i, m).
  for (uint p = sgi; p < C * C; p += NSG) {
    const uint i = p / C;
    const uint m = p % C;
    if (m > i) {
      if (lane == 0) {
        sA[i][m] = 0.0f;
        sM[i][m] = 0.0f;
      }
      continue;
    }
    float av = 0.0f, mv = 0.0f;
    for (int r = 0; r < NL; ++r) {
      const uint d = lane + 32 * r;
      if (d < Dk) {
        const float e = metal::exp(sgc[i][d] - sgc[m][d]);
        av += sk[i][d] * sk[m][d] * e;
        mv += sq[i][d] * sk[m][d] * e;
      }
    }
    av = simd_sum(av);
    mv = simd_sum(mv);
    if (lane == 0) {
      sA[i][m] = m < i ? sbeta[i] * av : 0.0f;
      sM[i][m] = mv;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 4. Tinv = (I + A)^-1 by forward substitution, one column per lane of SIMD-group 0.
  if (sgi == 0 && lane < C) {
    const uint c = lane;
    for (uint i = 0; i < C; ++i) {
      float x = 0.0f;
      if (i == c) {
        x = 1.0f;
      } else if (i > c) {
        for (uint m = c; m < i; ++m) {
          x -= sA[i][m] * sT[m][c];
        }
      }
      sT[i][c] = x;
    }
  }
  // 5. In place: q e^G, k e^G, k e^{G_C - G}, e^{G_C} (each thread owns channel d).
  for (uint d = tid; d < Dk; d += NT) {
    const float gend = sgc[C - 1][d];
    send[d] = metal::exp(gend);
    for (int t = 0; t < C; ++t) {
      const float gt = sgc[t][d];
      const float kx = sk[t][d];
      const float e = metal::exp(gt);
      sq[t][d] *= e;
      sk[t][d] = kx * e;
      sgc[t][d] = kx * metal::exp(gend - gt);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 6. Per value column: u, outputs, state.
  for (int c = 0; c < CPS; ++c) {
    const uint j = col0 + c;
    if (j >= Dv) {
      continue;
    }
    float r[C];
    float qs[C];
    for (int t = 0; t < C; ++t) {
      float pk = 0.0f, pq = 0.0f;
      for (int i = 0; i < NL; ++i) {
        const uint d = lane + 32 * i;
        if (d < Dk) {
          pk += sk[t][d] * st[c][i];
          pq += sq[t][d] * st[c][i];
        }
      }
      r[t] = simd_sum(pk);   // (k_t e^{G_t}) . S0
      qs[t] = simd_sum(pq);  // (q_t e^{G_t}) . S0
    }
    for (int t = 0; t < C; ++t) {
      const int tok = t0 + t;
      const float vx = tok < T ? static_cast<float>(v[((bi * T + tok) * H + h) * Dv + j]) : 0.0f;
      r[t] = sbeta[t] * (vx - r[t]);
    }
    float u[C];
    for (int t = 0; t < C; ++t) {
      float acc = 0.0f;
      for (int m = 0; m <= t; ++m) {
        acc += sT[t][m] * r[m];
      }
      u[t] = acc;
    }
    if (lane < C) {
      const uint t = lane;
      const int tok = t0 + int(t);
      if (tok < T) {
        float o = qs[t];
        for (uint i = 0; i <= t; ++i) {
          o += sM[t][i] * u[i];
        }
        y[((bi * T + tok) * H + h) * Dv + j] = static_cast<OutT>(o);
      }
    }
    for (int i = 0; i < NL; ++i) {
      const uint d = lane + 32 * i;
      if (d < Dk) {
        float s = send[d] * st[c][i];
        for (int t = 0; t < C; ++t) {
          s += sgc[t][d] * u[t];
        }
        st[c][i] = s;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int c = 0; c < CPS; ++c) {
  const uint j = col0 + c;
  for (int i = 0; i < NL; ++i) {
    const uint d = lane + 32 * i;
    if (j < Dv && d < Dk) {
      state_out[(n * Dv + j) * Dk + d] = st[c][i];
    }
  }
}
