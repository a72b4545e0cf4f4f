// sparse_mla_decode: one decode token of (Gated) MLA in the absorbed form, attending only to
// the latent + rope-key rows the indexer selected, split-K over the selection.
//
// Math: K31_SPEC.md section 3 "Gated MLA / Gated DSA" (mlx-lm's absorbed decode):
//     s_i = scale * (q_lat . c[idx_i] + q_pe . kpe[idx_i])      over valid idx_i
//     out = sum_i softmax(s)_i c[idx_i]                          (0 if nothing is valid)
// Reference op: kimi_mlx.metal.dsa.sparse_mla_decode.
// Kernel 1 (sparse_mla_partial): threadgroup z = (b, split); each SIMD-group is one head
// and runs an online softmax over its split's indices, writing (max, sum, unnormalised
// output). Kernel 2 (sparse_mla_combine): the stable log-sum-exp merge of the splits.
// An index outside [0, S) (e.g. -1 = masked) is skipped.
// sparse_mla_partial_q (last in this file) is kernel 1 over an affine-quantized latent
// cache; its combine step, sparse_mla_combine_q, is kernel 2's body under a second name (one
// body, two pipelines: the BF16 decode and the quantized one are each checked on the device
// and each falls back alone).

// @kernel sparse_mla_partial
// Inputs:   q_lat [B, H, 1, R]; q_pe [B, H, 1, P]; latent [B, S, R]; k_pe [B, S, P];
//           sel [B, K] int32; scalars S, K, NSPLIT (int), scale (float).
// Outputs:  part_o [B, NSPLIT, H, R] float32; part_ml [B, NSPLIT, H, 2] float32 (max, sum).
// Template: H, R, P.
// Grid (32, H, B * NSPLIT), threadgroup (32, HG, 1); no barriers.
constexpr int RL = (R + 31) / 32;
constexpr int PL = (P + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint h = thread_position_in_grid.y;
const uint z = thread_position_in_grid.z;
const uint bi = z / NSPLIT;
const uint sp = z % NSPLIT;
const int per = (K + NSPLIT - 1) / NSPLIT;
const int k0 = int(sp) * per;
const int k1 = metal::min(K, k0 + per);

float qr[RL];
float qp[PL];
float acc[RL];
const uint qrow = bi * H + h;
for (int i = 0; i < RL; ++i) {
  const uint d = lane + 32 * i;
  qr[i] = d < R ? scale * static_cast<float>(q_lat[qrow * R + d]) : 0.0f;
  acc[i] = 0.0f;
}
for (int i = 0; i < PL; ++i) {
  const uint d = lane + 32 * i;
  qp[i] = d < P ? scale * static_cast<float>(q_pe[qrow * P + d]) : 0.0f;
}

float m = -INFINITY;
float ssum = 0.0f;
for (int kk = k0; kk < k1; ++kk) {
  const int s = sel[bi * K + kk];
  if (s < 0 || s >= S) {
    continue;
  }
  const uint crow = bi * S + s;
  float cr[RL];
  float dot = 0.0f;
  for (int i = 0; i < RL; ++i) {
    const uint d = lane + 32 * i;
    cr[i] = d < R ? static_cast<float>(latent[crow * R + d]) : 0.0f;
    dot += qr[i] * cr[i];
  }
  for (int i = 0; i < PL; ++i) {
    const uint d = lane + 32 * i;
    if (d < P) {
      dot += qp[i] * static_cast<float>(k_pe[crow * P + d]);
    }
  }
  dot = simd_sum(dot);
  const float mn = metal::max(m, dot);
  const float corr = metal::exp(m - mn);  // 0 on the first valid key (m = -inf)
  const float p = metal::exp(dot - mn);
  ssum = ssum * corr + p;
  for (int i = 0; i < RL; ++i) {
    acc[i] = acc[i] * corr + p * cr[i];
  }
  m = mn;
}

const uint prow = (bi * NSPLIT + sp) * H + h;
for (int i = 0; i < RL; ++i) {
  const uint d = lane + 32 * i;
  if (d < R) {
    part_o[prow * R + d] = acc[i];
  }
}
if (lane == 0) {
  part_ml[prow * 2] = m;
  part_ml[prow * 2 + 1] = ssum;
}

// @kernel sparse_mla_combine sparse_mla_combine_q
// Inputs:   part_o [B, NSPLIT, H, R] float32; part_ml [B, NSPLIT, H, 2] float32;
//           scalar NSPLIT (int).
// Outputs:  out [B, H, 1, R] (OutT).
// Template: OutT, H, R.
// Grid (32, H, B), threadgroup (32, HG, 1); no barriers.
constexpr int RL = (R + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint h = thread_position_in_grid.y;
const uint bi = thread_position_in_grid.z;

float mx_ = -INFINITY;
for (int sp = 0; sp < NSPLIT; ++sp) {
  mx_ = metal::max(mx_, part_ml[((bi * NSPLIT + sp) * H + h) * 2]);
}
float acc[RL];
for (int i = 0; i < RL; ++i) {
  acc[i] = 0.0f;
}
float total = 0.0f;
if (mx_ > -INFINITY) {
  for (int sp = 0; sp < NSPLIT; ++sp) {
    const uint prow = (bi * NSPLIT + sp) * H + h;
    const float ms = part_ml[prow * 2];
    if (ms == -INFINITY) {
      continue;  // an empty split
    }
    const float wgt = metal::exp(ms - mx_);
    total += part_ml[prow * 2 + 1] * wgt;
    for (int i = 0; i < RL; ++i) {
      const uint d = lane + 32 * i;
      if (d < R) {
        acc[i] += part_o[prow * R + d] * wgt;
      }
    }
  }
}
const float inv = total > 0.0f ? 1.0f / total : 0.0f;
for (int i = 0; i < RL; ++i) {
  const uint d = lane + 32 * i;
  if (d < R) {
    out[(bi * H + h) * R + d] = static_cast<OutT>(acc[i] * inv);
  }
}
// @kernel sparse_mla_partial_q
// sparse_mla_partial over an affine-quantized latent cache (MLX's `mx.quantize` format,
// as the 8-bit cache keeps it): latent row s is the uint32 words latent_w[b, s, :], value
// d in bits BITS * (d % VPW) .. of word d / VPW (little end first, VPW = 32 / BITS values
// a word), dequantized here in float32 as latent_s[b, s, d / GS] * q + latent_b[b, s, d / GS].
// The rope keys k_pe stay unquantized. Same math, splits and outputs as sparse_mla_partial.
// Reference op: kimi_mlx.metal.dsa.sparse_mla_decode_q_reference (mx.dequantize, then
// kimi_mlx.metal.dsa.sparse_mla_decode).
// Inputs:   q_lat [B, H, 1, R]; q_pe [B, H, 1, P]; latent_w [B, S, R / VPW] uint32;
//           latent_s, latent_b [B, S, R / GS] (the cache dtype); k_pe [B, S, P];
//           sel [B, K] int32; scalars S, K, NSPLIT (int), scale (float).
// Outputs:  part_o [B, NSPLIT, H, R] float32; part_ml [B, NSPLIT, H, 2] float32 (max, sum).
// Template: H, R, P, BITS (4 or 8), GS (group size: 32, 64 or 128, dividing R).
// Grid (32, H, B * NSPLIT), threadgroup (32, HG, 1); no barriers. Lane `lane` holds the
// whole words lane + 32 i (one 32-bit load for VPW values).
constexpr int VPW = 32 / BITS;
constexpr uint QMASK = (1u << BITS) - 1u;
constexpr int RW = R / VPW;  // words per latent row
constexpr int NG = R / GS;   // scale groups per latent row
constexpr int WL = (RW + 31) / 32;
constexpr int PL = (P + 31) / 32;
const uint lane = thread_index_in_simdgroup;
const uint h = thread_position_in_grid.y;
const uint z = thread_position_in_grid.z;
const uint bi = z / NSPLIT;
const uint sp = z % NSPLIT;
const int per = (K + NSPLIT - 1) / NSPLIT;
const int k0 = int(sp) * per;
const int k1 = metal::min(K, k0 + per);

float qr[WL][VPW];
float qp[PL];
float acc[WL][VPW];
const uint qrow = bi * H + h;
for (int i = 0; i < WL; ++i) {
  const uint wd = lane + 32 * i;
  for (int j = 0; j < VPW; ++j) {
    qr[i][j] = wd < RW ? scale * static_cast<float>(q_lat[qrow * R + wd * VPW + j]) : 0.0f;
    acc[i][j] = 0.0f;
  }
}
for (int i = 0; i < PL; ++i) {
  const uint d = lane + 32 * i;
  qp[i] = d < P ? scale * static_cast<float>(q_pe[qrow * P + d]) : 0.0f;
}

float m = -INFINITY;
float ssum = 0.0f;
for (int kk = k0; kk < k1; ++kk) {
  const int s = sel[bi * K + kk];
  if (s < 0 || s >= S) {
    continue;
  }
  const uint crow = bi * S + s;
  float cr[WL][VPW];
  float dot = 0.0f;
  for (int i = 0; i < WL; ++i) {
    const uint wd = lane + 32 * i;
    if (wd < RW) {
      const uint word = latent_w[crow * RW + wd];
      const uint g = crow * NG + (wd * VPW) / GS;
      const float gs = static_cast<float>(latent_s[g]);
      const float gb = static_cast<float>(latent_b[g]);
      for (int j = 0; j < VPW; ++j) {
        cr[i][j] = gs * static_cast<float>((word >> (BITS * j)) & QMASK) + gb;
        dot += qr[i][j] * cr[i][j];
      }
    } else {
      for (int j = 0; j < VPW; ++j) {
        cr[i][j] = 0.0f;
      }
    }
  }
  for (int i = 0; i < PL; ++i) {
    const uint d = lane + 32 * i;
    if (d < P) {
      dot += qp[i] * static_cast<float>(k_pe[crow * P + d]);
    }
  }
  dot = simd_sum(dot);
  const float mn = metal::max(m, dot);
  const float corr = metal::exp(m - mn);  // 0 on the first valid key (m = -inf)
  const float p = metal::exp(dot - mn);
  ssum = ssum * corr + p;
  for (int i = 0; i < WL; ++i) {
    for (int j = 0; j < VPW; ++j) {
      acc[i][j] = acc[i][j] * corr + p * cr[i][j];
    }
  }
  m = mn;
}

const uint prow = (bi * NSPLIT + sp) * H + h;
for (int i = 0; i < WL; ++i) {
  const uint wd = lane + 32 * i;
  if (wd < RW) {
    for (int j = 0; j < VPW; ++j) {
      part_o[prow * R + wd * VPW + j] = acc[i][j];
    }
  }
}
if (lane == 0) {
  part_ml[prow * 2] = m;
  part_ml[prow * 2 + 1] = ssum;
}
