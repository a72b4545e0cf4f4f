// dsa_index_topk: K3.1 lightning-indexer scores of one query row against every cached
// index key, causal, then the row's top-K key positions by radix select on the float bits
// (no sort): four 8-bit histogram passes find the K-th largest score exactly, then one
// ordered compaction pass writes the keys above it and, in position order, as many keys
// equal to it as are needed. Keys before a batch row's `start` (its left padding in a
// continuous batch, kimi_mlx/cache.py BatchDSACache) are never allowed.
//
// Math: K31_SPEC.md section 3 "K3.1 lightning indexer" (DeepSeek-V3.2 indexer, no RoPE):
//     I[l, s] = sum_h w[l, h] * relu(q[l, h] . k[s])     allowed iff start[b] <= s <= offset + l
// Reference op: kimi_mlx.metal.dsa.dsa_index_topk.
//
// Inputs:   q [B, L, Hi, Di]; w [B, L, Hi]; kx [B, S, Di]; start [B] int32 (first allowed
//           key of each row, 0 without padding); scalars S, L, offset, K (= min(topk, S)).
// Outputs:  idx [B, L, K] int32: the selected positions (ascending among the keys above the
//           threshold, then the tied ones); a row with n = min(S, offset + l + 1) - start
//           <= K allowed keys gets start..start+n-1 followed by -1.
//           scores [B, L, S] float32: the row's scores (-inf where not allowed); scratch.
// Template: Hi, Di, NT (threads per threadgroup, a multiple of 32, <= 1024).
// Grid (NT, L, B), threadgroup (NT, 1, 1): one threadgroup per query row.
// Threadgroup memory: 4 * (Hi * Di + Hi + 256 + 2 * NT / 32 + 2) bytes.

// @kernel dsa_index_topk
constexpr uint NSG = NT / 32;
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sgi = simdgroup_index_in_threadgroup;
const uint l = threadgroup_position_in_grid.y;
const uint bi = threadgroup_position_in_grid.z;
const int limit = metal::min(S, offset + int(l) + 1);  // keys first .. limit-1 are allowed
const int first = metal::min(start[bi], limit);

threadgroup float sq[Hi][Di];
threadgroup float sw[Hi];
threadgroup atomic_uint hist[256];
threadgroup uint sgt[NSG];
threadgroup uint seq[NSG];
threadgroup uint sdigit[1];
threadgroup uint srem[1];

const uint qrow = bi * L + l;
for (uint e = tid; e < Hi * Di; e += NT) {
  sq[e / Di][e % Di] = static_cast<float>(q[qrow * Hi * Di + e]);
}
for (uint e = tid; e < Hi; e += NT) {
  sw[e] = static_cast<float>(w[qrow * Hi + e]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 1. Scores, one key per thread (the query row sits in threadgroup memory).
device float* srow = scores + qrow * S;
for (int s = tid; s < S; s += NT) {
  float sc = -INFINITY;
  if (s >= first && s < limit) {
    float acc[Hi];
    for (int hh = 0; hh < Hi; ++hh) {
      acc[hh] = 0.0f;
    }
    const uint koff = (bi * S + s) * Di;
    for (int d = 0; d < Di; ++d) {
      const float kd = static_cast<float>(kx[koff + d]);
      for (int hh = 0; hh < Hi; ++hh) {
        acc[hh] += sq[hh][d] * kd;
      }
    }
    sc = 0.0f;
    for (int hh = 0; hh < Hi; ++hh) {
      sc += sw[hh] * metal::max(acc[hh], 0.0f);
    }
  }
  srow[s] = sc;
}

device int* orow = idx + qrow * K;
if (limit - first <= K) {
  // Every allowed key is selected.
  for (int i = tid; i < K; i += NT) {
    orow[i] = i < limit - first ? first + i : -1;
  }
  return;
}
// The passes below read the scores from `first` on, so with a row start that is not a
// multiple of NT a thread reads scores another thread wrote: this barrier orders them
// (tests/test_metal_kernels.py plants a reversed mapping and checks the race report).
threadgroup_barrier(mem_flags::mem_device);

// 2. Radix select: the K-th largest key (float bits mapped to an order-preserving uint).
uint prefix = 0;
uint pmask = 0;
uint remaining = K;  // how many still to take among keys matching `prefix` on `pmask`
for (int pass = 0; pass < 4; ++pass) {
  const uint shift = 24 - 8 * pass;
  for (uint i = tid; i < 256; i += NT) {
    atomic_store_explicit(&hist[i], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int s = first + int(tid); s < limit; s += NT) {
    const uint bits = as_type<uint>(srow[s]);
    const uint key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    if ((key & pmask) == prefix) {
      atomic_fetch_add_explicit(&hist[(key >> shift) & 255u], 1u, memory_order_relaxed);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    uint above = 0;
    for (int dg = 255; dg >= 0; --dg) {
      const uint c = atomic_load_explicit(&hist[dg], memory_order_relaxed);
      if (above + c >= remaining) {
        sdigit[0] = uint(dg);
        srem[0] = remaining - above;
        break;
      }
      above += c;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  prefix |= sdigit[0] << shift;
  pmask |= 255u << shift;
  remaining = srem[0];
}
// `prefix` is now the K-th largest key; take every key above it and the first
// `remaining` keys equal to it.
const uint n_above = K - remaining;

// 3. Ordered compaction (SIMD prefix sums, then SIMD-group offsets).
uint base_gt = 0;
uint base_eq = 0;
for (int s0 = first; s0 < limit; s0 += NT) {
  const int s = s0 + int(tid);
  uint key = 0;
  if (s < limit) {
    const uint bits = as_type<uint>(srow[s]);
    key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  const uint gt = (s < limit && key > prefix) ? 1u : 0u;
  const uint eq = (s < limit && key == prefix) ? 1u : 0u;
  const uint pg = simd_prefix_exclusive_sum(gt);
  const uint pe = simd_prefix_exclusive_sum(eq);
  const uint tg = simd_sum(gt);
  const uint te = simd_sum(eq);
  if (lane == 0) {
    sgt[sgi] = tg;
    seq[sgi] = te;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint og = 0, oe = 0, all_g = 0, all_e = 0;
  for (uint w2 = 0; w2 < NSG; ++w2) {
    if (w2 < sgi) {
      og += sgt[w2];
      oe += seq[w2];
    }
    all_g += sgt[w2];
    all_e += seq[w2];
  }
  if (gt) {
    orow[base_gt + og + pg] = s;
  }
  if (eq) {
    const uint pos = base_eq + oe + pe;
    if (pos < remaining) {
      orow[n_above + pos] = s;
    }
  }
  base_gt += all_g;
  base_eq += all_e;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (base_gt >= n_above && base_eq >= remaining) {
    break;
  }
}
// @kernel dsa_index_topk_q
// dsa_index_topk over affine-quantized index keys (MLX's `mx.quantize` format, as the
// 8-bit cache keeps them): key s is the uint32 words kx_w[b, s, :], value d in bits
// BITS * (d % VPW) .. of word d / VPW (little end first, VPW = 32 / BITS values a word),
// dequantized here in float32 as kx_s[b, s, d / GS] * q + kx_b[b, s, d / GS]. Only the
// score loop differs from dsa_index_topk; the selection (from "2. Radix select" on) is the
// same text (tests/test_metal_kernels_quantized.py holds them equal).
// Reference op: kimi_mlx.metal.dsa.dsa_index_topk_q_reference (mx.dequantize, then
// kimi_mlx.metal.dsa.dsa_index_topk).
//
// Inputs:   q [B, L, Hi, Di]; w [B, L, Hi]; kx_w [B, S, Di / VPW] uint32; kx_s, kx_b
//           [B, S, Di / GS] (the cache dtype); start [B] int32; scalars S, L, offset, K.
// Outputs:  idx [B, L, K] int32 and scores [B, L, S] float32, as dsa_index_topk.
// Template: Hi, Di, NT, BITS (4 or 8), GS (group size: 32, 64 or 128, dividing Di).
// Grid (NT, L, B), threadgroup (NT, 1, 1); threadgroup memory as dsa_index_topk.
constexpr uint NSG = NT / 32;
constexpr int VPW = 32 / BITS;
constexpr uint QMASK = (1u << BITS) - 1u;
constexpr int DW = Di / VPW;  // words per index key
constexpr int NG = Di / GS;   // scale groups per index key
const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sgi = simdgroup_index_in_threadgroup;
const uint l = threadgroup_position_in_grid.y;
const uint bi = threadgroup_position_in_grid.z;
const int limit = metal::min(S, offset + int(l) + 1);  // keys first .. limit-1 are allowed
const int first = metal::min(start[bi], limit);

threadgroup float sq[Hi][Di];
threadgroup float sw[Hi];
threadgroup atomic_uint hist[256];
threadgroup uint sgt[NSG];
threadgroup uint seq[NSG];
threadgroup uint sdigit[1];
threadgroup uint srem[1];

const uint qrow = bi * L + l;
for (uint e = tid; e < Hi * Di; e += NT) {
  sq[e / Di][e % Di] = static_cast<float>(q[qrow * Hi * Di + e]);
}
for (uint e = tid; e < Hi; e += NT) {
  sw[e] = static_cast<float>(w[qrow * Hi + e]);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// 1. Scores, one key per thread (the query row sits in threadgroup memory).
device float* srow = scores + qrow * S;
for (int s = tid; s < S; s += NT) {
  float sc = -INFINITY;
  if (s >= first && s < limit) {
    float acc[Hi];
    for (int hh = 0; hh < Hi; ++hh) {
      acc[hh] = 0.0f;
    }
    const uint krow = bi * S + s;
    for (int wd = 0; wd < DW; ++wd) {
      const uint word = kx_w[krow * DW + wd];
      const uint g = krow * NG + (wd * VPW) / GS;
      const float gs = static_cast<float>(kx_s[g]);
      const float gb = static_cast<float>(kx_b[g]);
      for (int j = 0; j < VPW; ++j) {
        const float kd = gs * static_cast<float>((word >> (BITS * j)) & QMASK) + gb;
        const int d = wd * VPW + j;
        for (int hh = 0; hh < Hi; ++hh) {
          acc[hh] += sq[hh][d] * kd;
        }
      }
    }
    sc = 0.0f;
    for (int hh = 0; hh < Hi; ++hh) {
      sc += sw[hh] * metal::max(acc[hh], 0.0f);
    }
  }
  srow[s] = sc;
}

device int* orow = idx + qrow * K;
if (limit - first <= K) {
  // Every allowed key is selected.
  for (int i = tid; i < K; i += NT) {
    orow[i] = i < limit - first ? first + i : -1;
  }
  return;
}
// The passes below read the scores from `first` on, so with a row start that is not a
// multiple of NT a thread reads scores another thread wrote: this barrier orders them
// (tests/test_metal_kernels.py plants a reversed mapping and checks the race report).
threadgroup_barrier(mem_flags::mem_device);

// 2. Radix select: the K-th largest key (float bits mapped to an order-preserving uint).
uint prefix = 0;
uint pmask = 0;
uint remaining = K;  // how many still to take among keys matching `prefix` on `pmask`
for (int pass = 0; pass < 4; ++pass) {
  const uint shift = 24 - 8 * pass;
  for (uint i = tid; i < 256; i += NT) {
    atomic_store_explicit(&hist[i], 0u, memory_order_relaxed);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int s = first + int(tid); s < limit; s += NT) {
    const uint bits = as_type<uint>(srow[s]);
    const uint key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    if ((key & pmask) == prefix) {
      atomic_fetch_add_explicit(&hist[(key >> shift) & 255u], 1u, memory_order_relaxed);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid == 0) {
    uint above = 0;
    for (int dg = 255; dg >= 0; --dg) {
      const uint c = atomic_load_explicit(&hist[dg], memory_order_relaxed);
      if (above + c >= remaining) {
        sdigit[0] = uint(dg);
        srem[0] = remaining - above;
        break;
      }
      above += c;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  prefix |= sdigit[0] << shift;
  pmask |= 255u << shift;
  remaining = srem[0];
}
// `prefix` is now the K-th largest key; take every key above it and the first
// `remaining` keys equal to it.
const uint n_above = K - remaining;

// 3. Ordered compaction (SIMD prefix sums, then SIMD-group offsets).
uint base_gt = 0;
uint base_eq = 0;
for (int s0 = first; s0 < limit; s0 += NT) {
  const int s = s0 + int(tid);
  uint key = 0;
  if (s < limit) {
    const uint bits = as_type<uint>(srow[s]);
    key = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
  }
  const uint gt = (s < limit && key > prefix) ? 1u : 0u;
  const uint eq = (s < limit && key == prefix) ? 1u : 0u;
  const uint pg = simd_prefix_exclusive_sum(gt);
  const uint pe = simd_prefix_exclusive_sum(eq);
  const uint tg = simd_sum(gt);
  const uint te = simd_sum(eq);
  if (lane == 0) {
    sgt[sgi] = tg;
    seq[sgi] = te;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  uint og = 0, oe = 0, all_g = 0, all_e = 0;
  for (uint w2 = 0; w2 < NSG; ++w2) {
    if (w2 < sgi) {
      og += sgt[w2];
      oe += seq[w2];
    }
    all_g += sgt[w2];
    all_e += seq[w2];
  }
  if (gt) {
    orow[base_gt + og + pg] = s;
  }
  if (eq) {
    const uint pos = base_eq + oe + pe;
    if (pos < remaining) {
      orow[n_above + pos] = s;
    }
  }
  base_gt += all_g;
  base_eq += all_e;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (base_gt >= n_above && base_eq >= remaining) {
    break;
  }
}
