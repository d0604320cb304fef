/* y = x @ W^T (+ bias) for the few rows of a decode step, on CPU: float32, bfloat16 and int8 weights.
 *
 * At one to a few dozen rows a linear layer is a stream of its weights: every weight is read once and used
 * once per row, so the time is the weight bytes over the memory bandwidth, and what matters is reading them
 * in long sequential runs with enough independent accumulators to keep up. Two forms:
 *
 * - `linear_kn`: float32 weights stored [K, N] (an output's weights strided by N; the layout MKL's sgemm
 *   prefers for prefill, see `cpu_layout`): the halves of K streamed front to back up to 4 rows, buffered
 *   blocks of 64-column panels beyond; x's value broadcast.
 * - `linear_nk`: weights stored [N, K] (each output's weights contiguous): float32, bfloat16 or int8 with a
 *   float32 scale per output row; tiles of 4 outputs x 4 rows as dot products over K, reduced at the end. Or
 *   int4 in groups of 32 or 128 k with a scale each (small_linear_int4.h).
 *
 * Each output's sum is formed in the same order whatever the number of rows or threads, so a row's result does
 * not depend on the batch it is in. Activations are float32 or bfloat16 (the model's dtype); outputs the same.
 * Outputs are split over `nthreads` OpenMP threads: the library links torch's own libgomp (the same soname,
 * already loaded), so it runs on torch's thread team instead of a second one competing for the cores.
 * Built by ringsched/kernels/small_linear.py with -O3 -march=native; AVX-512 (F, BW, VL) gets intrinsics,
 * AVX512-BF16 the bfloat16 dot-product instruction, AVX2 with FMA its own intrinsics (small_linear_avx2.h), any other
 * CPU portable loops.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

/* Weight types of `linear_nk`; int4's group size is in its code, so callers (decode_layers.c's descriptor) pass
 * one word as for the others. */
enum { W_F32 = 0, W_BF16 = 1, W_INT8 = 2, W_INT4_G32 = 3, W_INT4_G128 = 4 };

static inline float bf16_to_f32(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch's conversion */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline void store_out(void *y, int y_bf16, int64_t i, float v) {
  if (y_bf16)
    ((uint16_t *)y)[i] = f32_to_bf16(v);
  else
    ((float *)y)[i] = v;
}

static inline float load_act(const void *x, int x_bf16, int64_t i) {
  return x_bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* ---------------------------------------------------------------------------------------------------------
 * [K, N] float32 weights: out[m, n] = sum_k x[m, k] * w[k * ldw + n]
 *
 * Every output's sum is two chains of fused multiply-adds, over k in [0, kh) and in [kh, K) (kh: half of K,
 * rounded up to 16), added at the end: a fixed order, whatever the rows, threads or path, so a row's result does
 * not depend on the batch it is in.
 * - Up to MB rows (`kn_stream`): the two halves of the weight's rows go to two threads (or one after the other),
 *   each reading its half front to back, one long sequential stream with software prefetch far ahead (the
 *   layout's column panels would jump N floats at every k: about 20% below the bandwidth at one row).
 * - More rows (`kn_blocked`, AVX-512): each thread takes its columns in panels of 64; a panel is walked in blocks
 *   of KN_BLOCK values of k, each copied into a contiguous buffer once and then used by every 4-row tile, its
 *   sums kept between blocks: the weights are read from memory once, not once per tile.
 * ------------------------------------------------------------------------------------------------------- */

#define MB 4 /* rows per tile */
#define KN_COLS 64
#define KN_BLOCK 64
#define KN_ROWS 64 /* rows per pass of kn_blocked: their sums stay in the first-level cache */
#define KN_RK 8    /* k per step of kn_stream */
#ifndef KN_PREFETCH
#define KN_PREFETCH 16384 /* bytes ahead of kn_stream's reads */
#endif
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#define INLINE static inline __attribute__((always_inline))
#define NB 4 /* outputs per tile of linear_nk */

static inline int64_t kn_half(int64_t K) {
  const int64_t kh = (K / 2 + 15) / 16 * 16;
  return kh < K ? kh : K;
}

/* Rows from which AVX2 takes kn_blocked_avx2: at 5-8 rows kn_stream was as fast or faster (SmolLM2's shapes, 2 threads,
 * AMD EPYC), at 16 the blocked path took half its time on the gate/up projection. */
#define KN2_MIN 8
#include "small_linear_avx2.h"

/* acc[m * N + c] for c in [c0, c1) += the chains over k in [k0, k1); inlined with constant `xb`. */
INLINE void kn_stream_x(const void *x, int64_t ldx, const int xb, int64_t M, int64_t k0, int64_t k1, const float *w,
                        int64_t ldw, int64_t c0, int64_t c1, float *acc, int64_t N) {
#if HAVE_AVX512
  for (int64_t kb = k0; kb < k1; kb += KN_RK) {
    const int kn = k1 - kb < KN_RK ? (int)(k1 - kb) : KN_RK;
    for (int64_t c = c0; c < c1; c += 16) {
      const __mmask16 mk = c1 - c >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (c1 - c)) - 1);
      __m512 wv[KN_RK];
      for (int k = 0; k < kn; k++) {
        wv[k] = _mm512_maskz_loadu_ps(mk, w + (kb + k) * ldw + c);
        _mm_prefetch((const char *)(w + (kb + k) * ldw + c) + KN_PREFETCH, _MM_HINT_T0);
      }
      for (int64_t m = 0; m < M; m++) {
        __m512 s = _mm512_maskz_loadu_ps(mk, acc + m * N + c);
        for (int k = 0; k < kn; k++) s = _mm512_fmadd_ps(_mm512_set1_ps(load_act(x, xb, m * ldx + kb + k)), wv[k], s);
        _mm512_mask_storeu_ps(acc + m * N + c, mk, s);
      }
    }
  }
#elif HAVE_AVX2
  kn_stream_avx2(x, ldx, xb, M, k0, k1, w, ldw, c0, c1, acc, N);
#else
  for (int64_t k = k0; k < k1; k++)
    for (int64_t m = 0; m < M; m++) {
      const float xv = load_act(x, xb, m * ldx + k);
      float *a = acc + m * N;
      const float *wk = w + k * ldw;
#pragma omp simd
      for (int64_t c = c0; c < c1; c++) a[c] += xv * wk[c];
    }
#endif
}

static void kn_stream(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const float *w, int64_t ldw,
                      int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  const int64_t kh = kn_half(K), groups = (N + 15) / 16;
  int64_t cols = nthreads / 2; /* column groups per half, with more than two threads */
  if (cols < 1) cols = 1;
  if (cols > groups) cols = groups;
  const int64_t tasks = 2 * cols, team = nthreads < tasks ? (nthreads < 1 ? 1 : nthreads) : tasks;
  float *acc = calloc((size_t)(2 * M * N), sizeof(float)); /* the two halves' sums */
  if (!acc) return;
#pragma omp parallel num_threads(team) if (team > 1)
  {
#pragma omp for schedule(static, 1)
    for (int64_t t = 0; t < tasks; t++) {
      const int64_t h = t % 2, g = t / 2, c0 = 16 * (groups * g / cols), c1g = 16 * (groups * (g + 1) / cols);
      const int64_t c1 = c1g < N ? c1g : N, k0 = h ? kh : 0, k1 = h ? K : kh;
      if (x_bf16) kn_stream_x(x, ldx, 1, M, k0, k1, w, ldw, c0, c1, acc + h * M * N, N);
      else kn_stream_x(x, ldx, 0, M, k0, k1, w, ldw, c0, c1, acc + h * M * N, N);
    }
#pragma omp for schedule(static)
    for (int64_t i = 0; i < M * N; i++) store_out(y, (int)y_bf16, i, acc[i] + acc[M * N + i] + (bias ? bias[i % N] : 0.0f));
  }
  free(acc);
}

#if HAVE_AVX512
/* One 4-row tile over a buffered block of kn values of k from k0; sums in accb[m][64]. */
INLINE void kn_block_tile(const float *buf, int kn, const void *x, int64_t ldx, const int xb, int64_t m0,
                          const int mb, int64_t k0, float *accb, int first) {
  __m512 acc[MB][4];
  for (int m = 0; m < mb; m++)
    for (int j = 0; j < 4; j++)
      acc[m][j] = first ? _mm512_setzero_ps() : _mm512_load_ps(accb + (m0 + m) * KN_COLS + 16 * j);
  for (int k = 0; k < kn; k++) {
    __m512 wv[4];
    for (int j = 0; j < 4; j++) wv[j] = _mm512_load_ps(buf + k * KN_COLS + 16 * j);
    for (int m = 0; m < mb; m++) {
      const __m512 xv = _mm512_set1_ps(load_act(x, xb, (m0 + m) * ldx + k0 + k));
      for (int j = 0; j < 4; j++) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
    }
  }
  for (int m = 0; m < mb; m++)
    for (int j = 0; j < 4; j++) _mm512_store_ps(accb + (m0 + m) * KN_COLS + 16 * j, acc[m][j]);
}

#define KN_BLOCK_CASE(MBV, XB) kn_block_tile(buf, kn, x, ldx, XB, m0, MBV, k0, accb[h], k0 == ks)

/* One panel of nc <= 64 columns from n0, for M <= KN_ROWS rows. */
static void kn_blocked_panel(const void *x, int64_t ldx, int xb, int64_t M, int64_t K, const float *w, int64_t ldw,
                             int64_t n0, int64_t nc, const float *bias, void *y, int y_bf16, int64_t N) {
  float buf[KN_BLOCK * KN_COLS] __attribute__((aligned(64)));
  float accb[2][KN_ROWS * KN_COLS] __attribute__((aligned(64)));
  __mmask16 mask[4];
  for (int j = 0; j < 4; j++) {
    const int64_t left = nc - 16 * j;
    mask[j] = left >= 16 ? (__mmask16)0xffff : left > 0 ? (__mmask16)((1u << left) - 1) : 0;
  }
  const int64_t kh = kn_half(K);
  memset(accb[1], 0, sizeof accb[1]); /* an empty second half (K <= 16) adds zeros */
  for (int h = 0; h < 2; h++) {
    const int64_t ks = h ? kh : 0, ke = h ? K : kh;
    for (int64_t k0 = ks; k0 < ke; k0 += KN_BLOCK) {
      const int kn = ke - k0 < KN_BLOCK ? (int)(ke - k0) : KN_BLOCK;
      for (int k = 0; k < kn; k++) {
        const float *wk = w + (k0 + k) * ldw + n0;
        for (int j = 0; j < 4; j++) _mm512_store_ps(buf + k * KN_COLS + 16 * j, _mm512_maskz_loadu_ps(mask[j], wk + 16 * j));
        for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wk + 16 * ldw + 16 * j), _MM_HINT_T0);
      }
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = M - m0 < MB ? M - m0 : MB;
        if (xb) {
          if (mb == 4) KN_BLOCK_CASE(4, 1); else if (mb == 3) KN_BLOCK_CASE(3, 1); else if (mb == 2) KN_BLOCK_CASE(2, 1); else KN_BLOCK_CASE(1, 1);
        } else {
          if (mb == 4) KN_BLOCK_CASE(4, 0); else if (mb == 3) KN_BLOCK_CASE(3, 0); else if (mb == 2) KN_BLOCK_CASE(2, 0); else KN_BLOCK_CASE(1, 0);
        }
      }
    }
  }
  for (int64_t m = 0; m < M; m++)
    for (int64_t c = 0; c < nc; c++)
      store_out(y, y_bf16, m * N + n0 + c, accb[0][m * KN_COLS + c] + accb[1][m * KN_COLS + c] + (bias ? bias[n0 + c] : 0.0f));
}

static void kn_blocked(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const float *w, int64_t ldw,
                       int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  /* Each thread takes an equal run of 16-column groups (whole 64-column panels would leave one thread a panel
   * more than the other on N = 576: 9 panels), walked in panels of up to 64 columns. */
  const int64_t groups = (N + 15) / 16, xsize = x_bf16 ? 2 : 4, ysize = y_bf16 ? 2 : 4;
  if (nthreads > groups) nthreads = groups;
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < nthreads; t++) {
    const int64_t g0 = groups * t / nthreads, g1 = groups * (t + 1) / nthreads, end = 16 * g1 < N ? 16 * g1 : N;
    for (int64_t n0 = 16 * g0; n0 < end; n0 += KN_COLS)
      for (int64_t r = 0; r < M; r += KN_ROWS)
        kn_blocked_panel((const char *)x + r * ldx * xsize, ldx, (int)x_bf16, M - r < KN_ROWS ? M - r : KN_ROWS, K, w,
                         ldw, n0, end - n0 < KN_COLS ? end - n0 : KN_COLS, bias, (char *)y + r * N * ysize, (int)y_bf16, N);
  }
}
#endif

int linear_kn(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const float *w, int64_t ldw, int64_t N,
              const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
#if HAVE_AVX512
  if (M > MB) {
    kn_blocked(x, ldx, x_bf16, M, K, w, ldw, N, bias, y, y_bf16, nthreads);
    return 0;
  }
#elif HAVE_AVX2
  if (M > KN2_MIN) {
    kn_blocked_avx2(x, ldx, x_bf16, M, K, w, ldw, N, bias, y, y_bf16, nthreads);
    return 0;
  }
#endif
  kn_stream(x, ldx, x_bf16, M, K, w, ldw, N, bias, y, y_bf16, nthreads);
  return 0;
}

/* ---------------------------------------------------------------------------------------------------------
 * [N, K] weights: out[m, n] = scale[n] * sum_k x[m, k] * w[n * K + k]   (scale: int8 only; int4: per group)
 * ------------------------------------------------------------------------------------------------------- */

#if HAVE_AVX512
INLINE __m512 widen_bf16(__m256i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16)); }

/* 16 weights (or fewer: `mk`) of type `wt` at `p`, widened to float32 */
INLINE __m512 load_w16(const void *p, const int wt, __mmask16 mk) {
  if (wt == W_F32) return _mm512_maskz_loadu_ps(mk, p);
  if (wt == W_BF16) return widen_bf16(_mm256_maskz_loadu_epi16(mk, p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mk, p)));
}

INLINE __m512 load_x16(const void *p, const int xb, __mmask16 mk) {
  return xb ? widen_bf16(_mm256_maskz_loadu_epi16(mk, p)) : _mm512_maskz_loadu_ps(mk, p);
}
#endif

#include "small_linear_int4.h"

#if !HAVE_AVX512 && !HAVE_AVX2
/* One row's dot product with one output's weights, in 16 lanes of partial sums as the vector path keeps. Not
 * inlined: the tile's constant row count would let the compiler vectorize (and, with -ffast-math, reassociate)
 * each copy its own way, and a row's result would then depend on how many rows shared its tile. */
__attribute__((noinline)) static float nk_dot(const char *xr, const int xb, const char *wr, const int wt, int64_t K) {
  enum { L = 16 };
  float part[L] = {0};
  for (int64_t k0 = 0; k0 < K; k0 += L)
    for (int l = 0; l < L && k0 + l < K; l++) {
      const int64_t k = k0 + l;
      const float wv = wt == W_F32    ? ((const float *)wr)[k]
                       : wt == W_BF16 ? bf16_to_f32(((const uint16_t *)wr)[k])
                                      : (float)((const int8_t *)wr)[k];
      part[l] += load_act(xr, xb, k) * wv;
    }
  float s = 0.0f;
  for (int l = 0; l < L; l++) s += part[l];
  return s;
}
#endif

/* Sums of one tile of `nb` outputs x `mb` rows into acc_out; inlined with constant `mb`, `wt`, `xb`. */
INLINE void nk_tile(const void *x, int64_t ldx, const int xb, int64_t m0, const int mb, int64_t K, const void *w, const int wt,
                    int64_t n0, int64_t nb, float acc_out[MB][NB]) {
  const int64_t wsize = wt == W_F32 ? 4 : wt == W_BF16 ? 2 : 1, xsize = xb ? 2 : 4;
  const char *wr[NB], *xr[MB];
  for (int i = 0; i < NB; i++) wr[i] = (const char *)w + (n0 + (i < nb ? i : 0)) * K * wsize;
  for (int m = 0; m < mb; m++) xr[m] = (const char *)x + (m0 + m) * ldx * xsize;
#if HAVE_AVX512
#if defined(__AVX512BF16__)
  if (wt == W_BF16 && xb) { /* pairs of bfloat16 products summed into float32 lanes, 32 weights a step */
    __m512 acc[MB][NB];
    for (int m = 0; m < mb; m++)
      for (int i = 0; i < NB; i++) acc[m][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const int64_t left = K - k;
      const __mmask32 mk = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
      __m512bh wv[NB];
      for (int i = 0; i < NB; i++) {
        wv[i] = (__m512bh)_mm512_maskz_loadu_epi16(mk, wr[i] + 2 * k);
        _mm_prefetch(wr[i] + 2 * k + PREFETCH_BYTES, _MM_HINT_T0);
      }
      for (int m = 0; m < mb; m++) {
        const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mk, xr[m] + 2 * k);
        for (int i = 0; i < NB; i++) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], xv, wv[i]);
      }
    }
    for (int m = 0; m < mb; m++)
      for (int i = 0; i < NB; i++) acc_out[m][i] = _mm512_reduce_add_ps(acc[m][i]);
    return;
  }
#endif
  __m512 acc[MB][NB];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc[m][i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const int64_t left = K - k;
    const __mmask16 mk = left >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << left) - 1);
    __m512 wv[NB];
    for (int i = 0; i < NB; i++) {
      wv[i] = load_w16(wr[i] + wsize * k, wt, mk);
      if (wt == W_F32 || (k & (64 / wsize / 16 * 16 - 1)) == 0) _mm_prefetch(wr[i] + wsize * k + PREFETCH_BYTES, _MM_HINT_T0);
    }
    for (int m = 0; m < mb; m++) {
      const __m512 xv = load_x16(xr[m] + xsize * k, xb, mk);
      for (int i = 0; i < NB; i++) acc[m][i] = _mm512_fmadd_ps(xv, wv[i], acc[m][i]);
    }
  }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = _mm512_reduce_add_ps(acc[m][i]);
#elif HAVE_AVX2
  for (int i = 0; i < nb; i++) nk_out_avx2(xr, xb, mb, K, wr[i], wt, i, acc_out);
#else
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = nk_dot(xr[m], xb, wr[i], wt, K);
#endif
}

#define NK_MB(WT, XB)                                                                                          \
  do {                                                                                                         \
    if (mb == 4) nk_tile(x, ldx, XB, m0, 4, K, w, WT, n0, nb, acc);                                                 \
    else if (mb == 3) nk_tile(x, ldx, XB, m0, 3, K, w, WT, n0, nb, acc);                                            \
    else if (mb == 2) nk_tile(x, ldx, XB, m0, 2, K, w, WT, n0, nb, acc);                                            \
    else nk_tile(x, ldx, XB, m0, 1, K, w, WT, n0, nb, acc);                                                         \
  } while (0)

#define NK_Q4(G, XB)                                                                                           \
  do {                                                                                                         \
    if (mb == 4) nk_tile_q4(x, ldx, XB, m0, 4, K, w, scales, G, n0, nb, acc);                                  \
    else if (mb == 3) nk_tile_q4(x, ldx, XB, m0, 3, K, w, scales, G, n0, nb, acc);                             \
    else if (mb == 2) nk_tile_q4(x, ldx, XB, m0, 2, K, w, scales, G, n0, nb, acc);                             \
    else nk_tile_q4(x, ldx, XB, m0, 1, K, w, scales, G, n0, nb, acc);                                          \
  } while (0)

int linear_nk(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const void *w, int64_t wtype,
              const float *scales, int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  if (wtype < W_F32 || wtype > W_INT4_G128) return 1;
  const int q4 = wtype == W_INT4_G32 || wtype == W_INT4_G128;
  if (q4 && (!scales || K % (wtype == W_INT4_G32 ? 32 : 128) != 0)) return 1;
#if !HAVE_AVX512
  /* bfloat16 activations widened once, not at every output's every load (a shuffle and a shift per 8 values bound
   * the 16-row step on AVX2: 23 against 31 ms for SmolLM2's 30 gate/up projections); exact, so the same sums */
  float *wide = NULL;
  if (x_bf16 && M > 1) {
    wide = malloc((size_t)(M * K) * sizeof(float));
    if (!wide) return 1;
    for (int64_t m = 0; m < M; m++)
      for (int64_t k = 0; k < K; k++) wide[m * K + k] = bf16_to_f32(((const uint16_t *)x)[m * ldx + k]);
    x = wide, ldx = K, x_bf16 = 0;
  }
#endif
  const int64_t tiles = (N + NB - 1) / NB;
  if (nthreads > tiles) nthreads = tiles;
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t t = 0; t < tiles; t++) {
    const int64_t n0 = t * NB, nb = N - n0 < NB ? N - n0 : NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = M - m0 < MB ? M - m0 : MB;
      float acc[MB][NB];
      if (wtype == W_F32) {
        if (x_bf16) NK_MB(W_F32, 1); else NK_MB(W_F32, 0);
      } else if (wtype == W_BF16) {
        if (x_bf16) NK_MB(W_BF16, 1); else NK_MB(W_BF16, 0);
      } else if (wtype == W_INT8) {
        if (x_bf16) NK_MB(W_INT8, 1); else NK_MB(W_INT8, 0);
      } else if (wtype == W_INT4_G32) {
        if (x_bf16) NK_Q4(32, 1); else NK_Q4(32, 0);
      } else {
        if (x_bf16) NK_Q4(128, 1); else NK_Q4(128, 0);
      }
      for (int64_t m = 0; m < mb; m++)
        for (int64_t i = 0; i < nb; i++) {
          float v = acc[m][i];
          if (scales && !q4) v *= scales[n0 + i]; /* int4's group scales are in its sums */
          if (bias) v += bias[n0 + i];
          store_out(y, (int)y_bf16, (m0 + m) * N + n0 + i, v);
        }
    }
  }
#if !HAVE_AVX512
  free(wide);
#endif
  return 0;
}
