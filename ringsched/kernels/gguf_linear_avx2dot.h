/* gguf_linear.c's integer path on CPUs with AVX2 and no AVX-512 (included by it): every type (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) multiplied as llama.cpp does on such CPUs, by integer dot products of the weights'
 * codes with the activations quantized to int8 per block of 32 (`quantize_row`), at any number of rows.
 *
 * A run of 32 values (a block, or a K-quant's sub-block) is decoded once per tile into 32 unsigned codes in value
 * order (`unit32`: nibbles, Q5's fifth bit, Q6_K's two high bits), with its scale per 16 values and its constant
 * term per 16 (a code offset times the scale, or a minimum): each of the tile's rows then takes `maddubs` (codes x
 * activations, pairs summed in int16: at most 63 x 127 x 2, no overflow) and `madd` by ones (int32 per 4 values),
 * converted and scaled by (weight scale x activation scale) into float lanes; the constant term goes in with the
 * activations' sums per 16 values. Q8_0's codes are signed: `maddubs` takes their magnitudes and the activations
 * with their signs (`sign`). A row's sums run in the same order whatever shares its tile, so its result does not
 * depend on its batch. The float path (`tile`) stays the reference the tests hold this one to, within the
 * activations' rounding.
 */

#if HAVE_AVX2
#define HAVE_AVX2DOT 1
#define DMB 4 /* rows per tile: 4 x 4 measured best of 1-4 x 2-4 at 16 rows (SmolLM2, Q4_0 and Q4_K) */
#define DNB 4 /* outputs per tile */

/* 0xFF in byte j where bit j of `bits` is set */
INLINE __m256i bytes_of_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                             _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                                               0x0101010101010101LL, 0x0000000000000000LL));
  const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
  return _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
}

/* Run b (values 32b .. 32b + 31) of a row of type t: its 32 codes in value order, unsigned (Q8_0: signed); the
 * scale of each 4-value lane of the int32 sums (values 0-15: lanes 0-3, 16-31: lanes 4-7); per 16 values the
 * constant term, times the activations' sum over them */
INLINE __m256i unit32(const uint8_t *row, const int t, int64_t b, __m256 *scale, float cst[2]) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  if (t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0) {
    const uint8_t *p = row + b * block_bytes(t);
    const float d = fp16(p);
    *scale = _mm256_set1_ps(d);
    if (t == Q8_0) {
      cst[0] = cst[1] = 0.0f;
      return _mm256_loadu_si256((const __m256i *)(p + 2));
    }
    const __m128i qs = _mm_loadu_si128((const __m128i *)(p + (t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8)));
    __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), low4);
    if (t == Q5_0 || t == Q5_1) {
      uint32_t qh;
      memcpy(&qh, p + (t == Q5_0 ? 2 : 4), 4);
      q = _mm256_or_si256(q, _mm256_and_si256(bytes_of_bits(qh), _mm256_set1_epi8(16)));
    }
    cst[0] = cst[1] = t == Q4_0 ? -8.0f * d : t == Q5_0 ? -16.0f * d : fp16(p + 2);
    return q;
  }
  const uint8_t *p = row + (b / 8) * block_bytes(t);
  const int c = (int)(b % 8);
  if (t == Q6_K) {
    const int half = c / 4, cc = c % 4;
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32 * (cc & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
    const __m256i lo = _mm256_and_si256(cc >> 1 ? _mm256_srli_epi16(ql, 4) : ql, low4);
    const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * cc), _mm256_set1_epi8(3));
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * half + 2 * cc;
    const float d = fp16(p + 208), s0 = d * (float)sc[0], s1 = d * (float)sc[1];
    *scale = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
    cst[0] = -32.0f * s0;
    cst[1] = -32.0f * s1;
    return _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));
  }
  int sc, mn;
  scale_min_k4(c, p + 4, &sc, &mn);
  *scale = _mm256_set1_ps(fp16(p) * (float)sc);
  cst[0] = cst[1] = -fp16(p + 2) * (float)mn;
  const __m256i qs = _mm256_loadu_si256((const __m256i *)(p + (t == Q4_K ? 16 : 48) + 32 * (c / 2)));
  __m256i q = _mm256_and_si256(c & 1 ? _mm256_srli_epi16(qs, 4) : qs, low4);
  if (t == Q5_K) {
    const __m256i bit = _mm256_set1_epi8((char)(1 << c));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_loadu_si256((const __m256i *)(p + 16)), bit), bit);
    q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(16)));
  }
  return q;
}

/* The int32 sums of codes x activations, per 4 values */
INLINE __m256i dot32(const __m256i q, const __m256i xq, const int t) {
  const __m256i pairs = t == Q8_0 ? _mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q))
                                  : _mm256_maddubs_epi16(q, xq);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* The constant terms times the activation sums. Not inlined: each inlined copy could be vectorized (and, with
 * -ffast-math, reassociated) its own way, and a row's result would then depend on how many rows shared its tile. */
__attribute__((noinline)) static float cst_dot(const float *c, const float *s, int64_t n) {
  float out = 0.0f;
  for (int64_t j = 0; j < n; j++) out += c[j] * s[j];
  return out;
}

/* `tile` by integer dot products: `mb` rows from m0 (quantized in xr) x `nb` outputs from n0. The constant terms
 * are kept per 16 values and taken with each row's activation sums in one dot product at the end. */
INLINE void tile_dot(const xrow_t *xr, int64_t m0, const int mb, int64_t K, const uint8_t *w, int64_t row_bytes,
                     const int t, int64_t n0, int64_t nb, float acc_out[DMB][DNB]) {
  const uint8_t *wr[DNB];
  for (int i = 0; i < DNB; i++) wr[i] = w + (n0 + (i < nb ? i : 0)) * row_bytes;
  __m256 acc[DMB][DNB];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < DNB; i++) acc[m][i] = _mm256_setzero_ps();
  float cst[DNB][K / 16];
  const int64_t per = row_bytes / (K / 32);
  for (int64_t b = 0; b < K / 32; b++) {
    __m256i q[DNB];
    __m256 sw[DNB];
    for (int i = 0; i < DNB; i++) {
      q[i] = unit32(wr[i], t, b, &sw[i], &cst[i][2 * b]);
      if ((b & 3) == 0) _mm_prefetch((const char *)wr[i] + b * per + PREFETCH_BYTES, _MM_HINT_T0);
    }
    for (int m = 0; m < mb; m++) {
      const xrow_t *r = &xr[m0 + m];
      const __m256i xq = _mm256_loadu_si256((const __m256i *)(r->q + 32 * b));
      const __m256 dx = _mm256_set1_ps(r->d[b]);
      for (int i = 0; i < DNB; i++)
        acc[m][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot32(q[i], xq, t)), _mm256_mul_ps(sw[i], dx), acc[m][i]);
    }
  }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < DNB; i++) {
      acc_out[m][i] = sum8(acc[m][i]) + cst_dot(cst[i], xr[m0 + m].s16, K / 16);
    }
}

#define DOT_MB(T)                                                                                              \
  case T:                                                                                                      \
    switch (mb) {                                                                                              \
      case 4: tile_dot(xr, m0, 4, K, w, row_bytes, T, n0, nb, acc); break;                                     \
      case 3: tile_dot(xr, m0, 3, K, w, row_bytes, T, n0, nb, acc); break;                                     \
      case 2: tile_dot(xr, m0, 2, K, w, row_bytes, T, n0, nb, acc); break;                                     \
      default: tile_dot(xr, m0, 1, K, w, row_bytes, T, n0, nb, acc);                                           \
    }                                                                                                          \
    break

/* gguf_linear by integer dot products; 2 when the activations' buffer cannot be had */
static int linear_dot(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w,
                      int64_t type, int64_t N, const float *bias, void *y, int64_t ldy, int64_t y_bf16,
                      int64_t nthreads) {
  const int64_t row_bytes = K / block_values(type) * block_bytes(type), tiles = (N + DNB - 1) / DNB;
  const int64_t each = K + (K / 32 + K / 32 + K / 16) * (int64_t)sizeof(float);
  char *buf = malloc((size_t)(M * each));
  xrow_t *xr = malloc((size_t)M * sizeof(xrow_t));
  if (!buf || !xr) {
    free(buf);
    free(xr);
    return 2;
  }
  for (int64_t m = 0; m < M; m++) {
    char *p = buf + m * each;
    float *f = (float *)(p + K);
    xr[m] = (xrow_t){(int8_t *)p, NULL, f, f + K / 32, f + 2 * (K / 32)};
    quantize_row((const char *)x + m * ldx * (x_bf16 ? 2 : 4), (int)x_bf16, K, &xr[m]);
  }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t ti = 0; ti < tiles; ti++) {
    const int64_t n0 = ti * DNB, nb = N - n0 < DNB ? N - n0 : DNB;
    for (int64_t m0 = 0; m0 < M; m0 += DMB) {
      const int64_t mb = M - m0 < DMB ? M - m0 : DMB;
      float acc[DMB][DNB];
      switch (type) {
        DOT_MB(Q4_0);
        DOT_MB(Q4_1);
        DOT_MB(Q5_0);
        DOT_MB(Q5_1);
        DOT_MB(Q8_0);
        DOT_MB(Q4_K);
        DOT_MB(Q5_K);
        DOT_MB(Q6_K);
      }
      for (int64_t m = 0; m < mb; m++)
        for (int64_t i = 0; i < nb; i++)
          store_out(y, (int)y_bf16, (m0 + m) * ldy + n0 + i, acc[m][i] + (bias ? bias[n0 + i] : 0.0f));
    }
  }
  free(buf);
  free(xr);
  return 0;
}
#else
#define HAVE_AVX2DOT 0
#endif
