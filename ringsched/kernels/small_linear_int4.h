/* The int4 tile of small_linear.c's `linear_nk` (included by it; small_linear.py puts this header's hash among
 * the compile flags, which key the build cache, so a change here rebuilds the library).
 *
 * Weights: [N, K/2] bytes, group-wise symmetric int4 (ringsched/kernels/quantize.py): q in [-8, 7] stored as
 * q + 8, one float32 scale per group of G consecutive k (scales [N, K/G]), w ~= q * scale. Within each block of 32
 * k (16 bytes) value j sits in byte j's low nibble and value j + 16 in its high nibble, as GGUF's Q4_0 lays out
 * its blocks. K is a multiple of G (32 or 128), which is a multiple of 32: no masks.
 *
 * An output's sum, per row: 16 lanes; per group a partial sum over its blocks (per block the low then the high
 * half, a fused multiply-add each), added into the lanes times the group's scale; the lanes reduced at the end.
 * The same order whatever the rows or threads, so a row's result does not depend on its batch.
 */

#if HAVE_AVX512
/* 16 bytes at `p` as the 32 weights of a block, as float32: low nibbles in `lo`, high in `hi` */
INLINE void load_q4_block(const uint8_t *p, __m512 *lo, __m512 *hi) {
  const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f), eight = _mm_set1_epi8(8);
  const __m128i l = _mm_sub_epi8(_mm_and_si128(b, mask), eight);
  const __m128i h = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(b, 4), mask), eight);
  *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(l));
  *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(h));
}
#endif

#if !HAVE_AVX512 && !HAVE_AVX2
/* One row's sum with one output's int4 weights, as above. Not inlined: the tile's constant row count would let the
 * compiler vectorize (and, with -ffast-math, reassociate) each copy its own way (small_linear.c's `nk_dot`). */
__attribute__((noinline)) static float q4_dot(const char *xr, const int xb, const uint8_t *wr, const float *sr,
                                              int64_t K, int64_t g) {
  enum { L = 16 };
  float lanes[L] = {0};
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    float part[L] = {0};
    for (int64_t k = k0; k < k0 + g; k += 32)
      for (int l = 0; l < L; l++) {
        const uint8_t b = wr[k / 2 + l];
        part[l] += load_act(xr, xb, k + l) * (float)((int)(b & 0x0f) - 8);
        part[l] += load_act(xr, xb, k + 16 + l) * (float)((int)(b >> 4) - 8);
      }
    for (int l = 0; l < L; l++) lanes[l] += part[l] * sr[k0 / g];
  }
  float s = 0.0f;
  for (int l = 0; l < L; l++) s += lanes[l];
  return s;
}
#endif

/* Sums of one tile of `nb` outputs x `mb` rows of int4 weights with groups of `g` into acc_out (scales applied);
 * inlined with constant `mb`, `xb`, `g`. */
INLINE void nk_tile_q4(const void *x, int64_t ldx, const int xb, int64_t m0, const int mb, int64_t K, const void *w,
                       const float *scales, const int64_t g, int64_t n0, int64_t nb, float acc_out[MB][NB]) {
  const int64_t xsize = xb ? 2 : 4, ng = K / g;
  const uint8_t *wr[NB];
  const float *sr[NB];
  const char *xr[MB];
  for (int i = 0; i < NB; i++) {
    const int64_t n = n0 + (i < nb ? i : 0);
    wr[i] = (const uint8_t *)w + n * (K / 2);
    sr[i] = scales + n * ng;
  }
  for (int m = 0; m < mb; m++) xr[m] = (const char *)x + (m0 + m) * ldx * xsize;
#if HAVE_AVX512
  __m512 acc[MB][NB];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc[m][i] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += g) {
    __m512 part[MB][NB];
    for (int m = 0; m < mb; m++)
      for (int i = 0; i < NB; i++) part[m][i] = _mm512_setzero_ps();
    for (int64_t k = k0; k < k0 + g; k += 32) {
      __m512 lo[NB], hi[NB];
      for (int i = 0; i < NB; i++) {
        load_q4_block(wr[i] + k / 2, &lo[i], &hi[i]);
        if ((k & 127) == 0) _mm_prefetch((const char *)wr[i] + k / 2 + PREFETCH_BYTES, _MM_HINT_T0);
      }
      for (int m = 0; m < mb; m++) {
        const __m512 xl = load_x16(xr[m] + xsize * k, xb, 0xffff), xh = load_x16(xr[m] + xsize * (k + 16), xb, 0xffff);
        for (int i = 0; i < NB; i++) part[m][i] = _mm512_fmadd_ps(xh, hi[i], _mm512_fmadd_ps(xl, lo[i], part[m][i]));
      }
    }
    for (int i = 0; i < NB; i++) {
      const __m512 s = _mm512_set1_ps(sr[i][k0 / g]);
      for (int m = 0; m < mb; m++) acc[m][i] = _mm512_fmadd_ps(part[m][i], s, acc[m][i]);
    }
  }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = _mm512_reduce_add_ps(acc[m][i]);
#elif HAVE_AVX2
  for (int i = 0; i < nb; i++) nk_out_q4_avx2(xr, xb, mb, K, wr[i], sr[i], g, i, acc_out);
#else
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = q4_dot(xr[m], xb, wr[i], sr[i], K, g);
#endif
}
