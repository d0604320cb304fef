/* The AVX2 + FMA forms of small_linear.c's kernels, for x86 CPUs without AVX-512 (AMD's Zen 2 and 3, Intel's
 * client cores): 8 float32 lanes a register and 16 registers, against AVX-512's 16 lanes and 32 registers. Included
 * by small_linear.c (whose build flags carry this header's hash, so a change here rebuilds the library).
 *
 * The portable loops they replace kept a row's sums in memory: every multiply-add loaded and stored its sum, and a
 * step of 6 rows cost ~3x a step of 1 on SmolLM2's shapes. Here the sums stay in registers while a block of the
 * weights is in the first-level cache, so up to a few rows a step is still the stream of the weights.
 *
 * Each output's sum is formed in the same order whatever the rows or threads (a chain of fused multiply-adds per
 * lane, lanes reduced in a fixed order), so a row's result does not depend on the batch it is in.
 */

#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>
#define HAVE_AVX2 1

/* ---- [K, N] float32 weights (linear_kn): acc[m * N + c], c in [c0, c1), += the chains over k in [k0, k1) ----
 * Per 8 columns and a block of KN_RK values of k the 8 weight vectors are held in registers and every row's sums
 * run through them: one broadcast load per multiply-add. */

/* The sums of 8 columns at `c` over the KN_RK k from kb, for all M rows (KN_RK weight vectors held) */
INLINE void kn8_block(const void *x, int64_t ldx, const int xb, int64_t M, int64_t kb, const float *w, int64_t ldw,
                      int64_t c, float *acc, int64_t N) {
  __m256 wv[KN_RK];
  for (int k = 0; k < KN_RK; k++) wv[k] = _mm256_loadu_ps(w + (kb + k) * ldw + c);
  for (int64_t m = 0; m < M; m++) {
    __m256 s = _mm256_loadu_ps(acc + m * N + c);
    for (int k = 0; k < KN_RK; k++) s = _mm256_fmadd_ps(_mm256_set1_ps(load_act(x, xb, m * ldx + kb + k)), wv[k], s);
    _mm256_storeu_ps(acc + m * N + c, s);
  }
}

/* The same sums, one column and one k at a time: the columns past the last 8 and a block of fewer than KN_RK k */
INLINE void kn_scalar(const void *x, int64_t ldx, const int xb, int64_t M, int64_t k0, int64_t k1, const float *w,
                      int64_t ldw, int64_t c0, int64_t c1, float *acc, int64_t N) {
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = c0; c < c1; c++) {
      float s = acc[m * N + c];
      for (int64_t k = k0; k < k1; k++) s = fmaf(load_act(x, xb, m * ldx + k), w[k * ldw + c], s);
      acc[m * N + c] = s;
    }
}

INLINE void kn_stream_avx2(const void *x, int64_t ldx, const int xb, int64_t M, int64_t k0, int64_t k1, const float *w,
                           int64_t ldw, int64_t c0, int64_t c1, float *acc, int64_t N) {
  const int64_t c8 = c0 + (c1 - c0) / 8 * 8;
  for (int64_t kb = k0; kb < k1; kb += KN_RK) {
    if (k1 - kb < KN_RK) {
      kn_scalar(x, ldx, xb, M, kb, k1, w, ldw, c0, c1, acc, N);
      break;
    }
    for (int64_t c = c0; c < c8; c += 8) {
      if ((c & 15) == 0)
        for (int k = 0; k < KN_RK; k++) _mm_prefetch((const char *)(w + (kb + k) * ldw + c) + KN_PREFETCH, _MM_HINT_T0);
      kn8_block(x, ldx, xb, M, kb, w, ldw, c, acc, N);
    }
    kn_scalar(x, ldx, xb, M, kb, kb + KN_RK, w, ldw, c8, c1, acc, N);
  }
}

/* ---- [N, K] weights (linear_nk): float32, bfloat16 or int8 ----
 * One output at a time, its weights read once for all the tile's rows; per row 16 lanes of partial sums (two
 * registers), reduced at the end. */

INLINE __m256 widen8_bf16(__m128i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)); }

/* 8 weights of type `wt` at `p` as float32 */
INLINE __m256 load_w8(const char *p, const int wt) {
  if (wt == W_F32) return _mm256_loadu_ps((const float *)p);
  if (wt == W_BF16) return widen8_bf16(_mm_loadu_si128((const __m128i *)p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

INLINE __m256 load_x8(const char *p, const int xb) {
  return xb ? widen8_bf16(_mm_loadu_si128((const __m128i *)p)) : _mm256_loadu_ps((const float *)p);
}

/* The 8 lanes added in a fixed order */
INLINE float sum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}

/* The last K % 16 values of a row as 16 float32 lanes, zero past K */
static inline void tail16(const char *p, int64_t k, int64_t K, const int wt, float out[16]) {
  for (int l = 0; l < 16; l++) {
    const int64_t i = k + l;
    out[l] = i >= K            ? 0.0f
             : wt == W_F32     ? ((const float *)p)[i]
             : wt == W_BF16    ? bf16_to_f32(((const uint16_t *)p)[i])
                               : (float)((const int8_t *)p)[i];
  }
}

/* acc_out[m][i] for one output `i` of the tile and `mb` rows; inlined with constant `mb`, `wt`, `xb` */
INLINE void nk_out_avx2(const char *const *xr, const int xb, const int mb, int64_t K, const char *wr, const int wt,
                        int i, float acc_out[MB][NB]) {
  const int64_t wsize = wt == W_F32 ? 4 : wt == W_BF16 ? 2 : 1, xsize = xb ? 2 : 4, k16 = K / 16 * 16;
  __m256 acc[MB][2];
  for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k16; k += 16) {
    if ((k * wsize & 63) == 0) _mm_prefetch(wr + wsize * k + PREFETCH_BYTES, _MM_HINT_T0);
    const __m256 w0 = load_w8(wr + wsize * k, wt), w1 = load_w8(wr + wsize * (k + 8), wt);
    for (int m = 0; m < mb; m++) {
      acc[m][0] = _mm256_fmadd_ps(load_x8(xr[m] + xsize * k, xb), w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(load_x8(xr[m] + xsize * (k + 8), xb), w1, acc[m][1]);
    }
  }
  if (k16 < K) {
    float wt16[16], xt16[16];
    tail16(wr, k16, K, wt, wt16);
    for (int m = 0; m < mb; m++) {
      tail16(xr[m], k16, K, xb ? W_BF16 : W_F32, xt16);
      acc[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xt16), _mm256_loadu_ps(wt16), acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xt16 + 8), _mm256_loadu_ps(wt16 + 8), acc[m][1]);
    }
  }
  for (int m = 0; m < mb; m++) acc_out[m][i] = sum8(_mm256_add_ps(acc[m][0], acc[m][1]));
}

/* ---- int4 weights in groups of g (small_linear_int4.h's layout) ----
 * One output at a time; per row and group 16 lanes (two registers) over its blocks, the low then the high half of
 * each block, added into the row's lanes times the group's scale. */

/* 16 bytes at `p` as the 32 weights of a block, as float32: low nibbles in lo[0..1], high in hi[0..1] */
INLINE void load_q4_block8(const uint8_t *p, __m256 lo[2], __m256 hi[2]) {
  const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i l = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
  const __m128i h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight);
  lo[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(l));
  lo[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(l, 8)));
  hi[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h));
  hi[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(h, 8)));
}

INLINE void nk_out_q4_avx2(const char *const *xr, const int xb, const int mb, int64_t K, const uint8_t *wr,
                           const float *sr, const int64_t g, int i, float acc_out[MB][NB]) {
  const int64_t xsize = xb ? 2 : 4;
  __m256 acc[MB][2];
  for (int m = 0; m < mb; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    __m256 part[MB][2];
    for (int m = 0; m < mb; m++) part[m][0] = part[m][1] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 32) {
      __m256 lo[2], hi[2];
      load_q4_block8(wr + k / 2, lo, hi);
      if ((k & 127) == 0) _mm_prefetch((const char *)wr + k / 2 + PREFETCH_BYTES, _MM_HINT_T0);
      for (int m = 0; m < mb; m++)
        for (int j = 0; j < 2; j++) {
          const __m256 xl = load_x8(xr[m] + xsize * (k + 8 * j), xb), xh = load_x8(xr[m] + xsize * (k + 16 + 8 * j), xb);
          part[m][j] = _mm256_fmadd_ps(xh, hi[j], _mm256_fmadd_ps(xl, lo[j], part[m][j]));
        }
    }
    const __m256 s = _mm256_set1_ps(sr[k0 / g]);
    for (int m = 0; m < mb; m++)
      for (int j = 0; j < 2; j++) acc[m][j] = _mm256_fmadd_ps(part[m][j], s, acc[m][j]);
  }
  for (int m = 0; m < mb; m++) acc_out[m][i] = sum8(_mm256_add_ps(acc[m][0], acc[m][1]));
}
#else
#define HAVE_AVX2 0
#endif
