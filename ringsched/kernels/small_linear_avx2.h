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

/* ---- [K, N] float32 weights, more than KN2_MIN rows (kn_blocked_avx2) ----
 * Each thread takes its columns in panels of KN2_COLS; a panel is walked in blocks of KN2_BLOCK values of k, each
 * copied once into a contiguous buffer (zero past the panel's last column) and then used by every 4-row tile: the
 * weights are read from memory once, not once per tile, and a tile holds 4 x 3 sums in registers, so a weight
 * vector loaded serves 4 rows and an activation broadcast 3 vectors. While a block computes, its first tile
 * prefetches the next block's rows (without, the copies waited on memory: ~25% slower at 16 rows). Every sum is the
 * same two chains of fused multiply-adds as kn_stream's, in the same order, so a row's result is kn_stream's bit for
 * bit. */
#define KN2_COLS 24
#define KN2_BLOCK 128

/* One tile of mb <= MB rows over a buffered block of kn values of k from k0; sums in accb[m][KN2_COLS] */
INLINE void kn2_tile(const float *buf, int kn, const void *x, int64_t ldx, const int xb, int64_t m0, const int mb,
                     int64_t k0, float *accb, int first, const float *next, int64_t ldw, int npf) {
  __m256 acc[MB][3];
  for (int m = 0; m < mb; m++)
    for (int j = 0; j < 3; j++)
      acc[m][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(accb + (m0 + m) * KN2_COLS + 8 * j);
  for (int k = 0; k < kn; k++) {
    __m256 w0 = _mm256_load_ps(buf + k * KN2_COLS), w1 = _mm256_load_ps(buf + k * KN2_COLS + 8),
           w2 = _mm256_load_ps(buf + k * KN2_COLS + 16);
    /* kept in registers: GCC folded them into each multiply-add, 12 loads a k instead of 3 */
    __asm__("" : "+x"(w0), "+x"(w1), "+x"(w2));
    if (k < npf) { /* the next block's rows on their way while this one computes */
      _mm_prefetch((const char *)(next + k * ldw), _MM_HINT_T0);
      _mm_prefetch((const char *)(next + k * ldw + 16), _MM_HINT_T0);
      _mm_prefetch((const char *)(next + k * ldw + 23), _MM_HINT_T0);
    }
    for (int m = 0; m < mb; m++) {
      const __m256 xv = _mm256_set1_ps(load_act(x, xb, (m0 + m) * ldx + k0 + k));
      acc[m][0] = _mm256_fmadd_ps(xv, w0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(xv, w1, acc[m][1]);
      acc[m][2] = _mm256_fmadd_ps(xv, w2, acc[m][2]);
    }
  }
  for (int m = 0; m < mb; m++)
    for (int j = 0; j < 3; j++) _mm256_store_ps(accb + (m0 + m) * KN2_COLS + 8 * j, acc[m][j]);
}

#define KN2_CASE(MBV, XB) kn2_tile(buf, kn, x, ldx, XB, m0, MBV, k0, accb[h], k0 == ks, next, ldw, m0 ? 0 : npf)

/* One panel of nc <= KN2_COLS columns from n0, for M <= KN_ROWS rows */
static void kn2_panel(const void *x, int64_t ldx, int xb, int64_t M, int64_t K, const float *w, int64_t ldw, int64_t n0,
                      int64_t nc, const float *bias, void *y, int y_bf16, int64_t N) {
  float buf[KN2_BLOCK * KN2_COLS] __attribute__((aligned(32)));
  float accb[2][KN_ROWS * KN2_COLS] __attribute__((aligned(32)));
  __m256i mask[3];
  for (int j = 0; j < 3; j++) {
    const int64_t left = nc - 8 * j;
    mask[j] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(left < 0 ? 0 : left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  const int64_t kh = kn_half(K);
  memset(accb[1], 0, sizeof accb[1]); /* an empty second half (K <= 16) adds zeros */
  for (int h = 0; h < 2; h++) {
    const int64_t ks = h ? kh : 0, ke = h ? K : kh;
    for (int64_t k0 = ks; k0 < ke; k0 += KN2_BLOCK) {
      const int kn = ke - k0 < KN2_BLOCK ? (int)(ke - k0) : KN2_BLOCK;
      for (int k = 0; k < kn; k++) {
        const float *wk = w + (k0 + k) * ldw + n0;
        for (int j = 0; j < 3; j++) _mm256_store_ps(buf + k * KN2_COLS + 8 * j, _mm256_maskload_ps(wk + 8 * j, mask[j]));
      }
      const int64_t after = k0 + kn < K ? k0 + kn : K, npf = K - after < KN2_BLOCK ? K - after : KN2_BLOCK;
      const float *next = w + after * ldw + n0;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = M - m0 < MB ? M - m0 : MB;
        if (xb) {
          if (mb == 4) KN2_CASE(4, 1); else if (mb == 3) KN2_CASE(3, 1); else if (mb == 2) KN2_CASE(2, 1); else KN2_CASE(1, 1);
        } else {
          if (mb == 4) KN2_CASE(4, 0); else if (mb == 3) KN2_CASE(3, 0); else if (mb == 2) KN2_CASE(2, 0); else KN2_CASE(1, 0);
        }
      }
    }
  }
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < nc; c++)
      store_out(y, y_bf16, m * N + n0 + c, accb[0][m * KN2_COLS + c] + accb[1][m * KN2_COLS + c] + (bias ? bias[n0 + c] : 0.0f));
}

static void kn_blocked_avx2(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const float *w, int64_t ldw,
                            int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  /* Each thread takes an equal run of 8-column groups, walked in panels of up to KN2_COLS columns */
  const int64_t groups = (N + 7) / 8, xsize = x_bf16 ? 2 : 4, ysize = y_bf16 ? 2 : 4;
  if (nthreads > groups) nthreads = groups;
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < nthreads; t++) {
    const int64_t g0 = groups * t / nthreads, g1 = groups * (t + 1) / nthreads, end = 8 * g1 < N ? 8 * g1 : N;
    for (int64_t n0 = 8 * g0; n0 < end; n0 += KN2_COLS)
      for (int64_t r = 0; r < M; r += KN_ROWS)
        kn2_panel((const char *)x + r * ldx * xsize, ldx, (int)x_bf16, M - r < KN_ROWS ? M - r : KN_ROWS, K, w, ldw, n0,
                  end - n0 < KN2_COLS ? end - n0 : KN2_COLS, bias, (char *)y + r * N * ysize, (int)y_bf16, N);
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
