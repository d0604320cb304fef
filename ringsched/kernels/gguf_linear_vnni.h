/* gguf_linear.c's integer path (included by it), where the CPU has AVX512-VNNI: the 32-value-block types (Q4_0,
 * Q4_1, Q5_0, Q5_1, Q8_0) multiplied as llama.cpp does, by integer dot products of the blocks' codes with the
 * activations quantized to int8 per block of 32 (`quantize_rows`, a scale each: max|x| / 127).
 *
 * Two blocks (64 values) a step: their codes as 64 bytes (4-bit codes split into nibbles in value order, Q5's high
 * bit added from its mask, Q8_0's signed codes as they are), one `vpdpbusd` per activation row giving each block's
 * sum in 8 lanes, which are converted and scaled by (weight scale x activation scale) per block into float lanes.
 * A code offset (Q4_0's 8, Q5_0's 16) or a block minimum (the _1 types) contributes its constant times the block's
 * activation sum. Q8_0's codes are signed, as are the activations: `vpdpbusd` takes the activations + 128 unsigned
 * and the codes' own sum times 128 is taken back. The float path (`tile`) stays the reference the tests hold this
 * one to, within the activations' rounding.
 */

#if HAVE_AVX512 && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define HAVE_VNNI 1

/* the 64 codes of blocks b and b + 1 of a row of type t, in value order; c0, c1: each block's constant term per unit
 * of activation sum (-offset * d or the minimum); d0, d1: its scale */
INLINE __m512i codes64(const uint8_t *row, const int t, int64_t b, float *d0, float *d1, float *c0, float *c1) {
  const int bb = t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : 34;
  const uint8_t *p0 = row + b * bb, *p1 = p0 + bb;
  *d0 = fp16(p0);
  *d1 = fp16(p1);
  if (t == Q8_0) {
    *c0 = *c1 = 0.0f;
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(p0 + 2))),
                              _mm256_loadu_si256((const __m256i *)(p1 + 2)), 1);
  }
  const int qo = t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8;
  const __m256i q = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p1 + qo)),
                                     _mm_loadu_si128((const __m128i *)(p0 + qo)));
  const __m256i mask = _mm256_set1_epi8(0x0f);
  const __m256i lo = _mm256_and_si256(q, mask), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), mask);
  const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); /* lo0 lo1 hi0 hi1 */
  __m512i c = _mm512_shuffle_i64x2(both, both, _MM_SHUFFLE(3, 1, 2, 0));      /* lo0 hi0 lo1 hi1 */
  if (t == Q5_0 || t == Q5_1) {
    uint32_t h0, h1;
    memcpy(&h0, p0 + (t == Q5_0 ? 2 : 4), 4);
    memcpy(&h1, p1 + (t == Q5_0 ? 2 : 4), 4);
    c = _mm512_mask_add_epi8(c, (__mmask64)h0 | ((__mmask64)h1 << 32), c, _mm512_set1_epi8(16));
  }
  if (t == Q4_0 || t == Q5_0) {
    const float off = t == Q4_0 ? 8.0f : 16.0f;
    *c0 = -off * *d0;
    *c1 = -off * *d1;
  } else {
    *c0 = fp16(p0 + 2);
    *c1 = fp16(p1 + 2);
  }
  return c;
}

/* `tile` by integer dot products, for the 32-value-block types with an even number of blocks a row */
INLINE void tile_vnni(const xrow_t *xr, int64_t m0, const int mb, int64_t K, const uint8_t *w, int64_t row_bytes,
                      const int t, int64_t n0, int64_t nb, float acc_out[MB][NB]) {
  const uint8_t *wr[NB];
  for (int i = 0; i < NB; i++) wr[i] = w + (n0 + (i < nb ? i : 0)) * row_bytes;
  __m512 acc[MB][NB];
  float off[MB][NB];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) {
      acc[m][i] = _mm512_setzero_ps();
      off[m][i] = 0.0f;
    }
  const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
  const int64_t per = row_bytes / (K / 32);
  for (int64_t b = 0; b < K / 32; b += 2) {
    __m512i c[NB], csum[NB];
    __m512 sw[NB]; /* each block's weight scale, in its 8 lanes */
    float d0[NB], d1[NB], c0[NB], c1[NB];
    for (int i = 0; i < NB; i++) {
      c[i] = codes64(wr[i], t, b, &d0[i], &d1[i], &c0[i], &c1[i]);
      sw[i] = _mm512_insertf32x8(_mm512_set1_ps(d0[i]), _mm256_set1_ps(d1[i]), 1);
      if (t == Q8_0) csum[i] = _mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, c[i]), 7);
      if ((b & 7) == 0) _mm_prefetch((const char *)wr[i] + b * per + PREFETCH_BYTES, _MM_HINT_T0);
    }
    for (int m = 0; m < mb; m++) {
      const xrow_t *r = &xr[m0 + m];
      const __m512i xv = _mm512_loadu_si512((const void *)(t == Q8_0 ? (const void *)(r->u + 32 * b)
                                                                     : (const void *)(r->q + 32 * b)));
      const float sx0 = r->s[b], sx1 = r->s[b + 1];
      const __m512 sxd = _mm512_insertf32x8(_mm512_set1_ps(r->d[b]), _mm256_set1_ps(r->d[b + 1]), 1);
      for (int i = 0; i < NB; i++) {
        const __m512i s = t == Q8_0 ? _mm512_sub_epi32(_mm512_dpbusd_epi32(zero, xv, c[i]), csum[i])
                                    : _mm512_dpbusd_epi32(zero, c[i], xv);
        acc[m][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(sw[i], sxd), acc[m][i]);
        off[m][i] += c0[i] * sx0 + c1[i] * sx1;
      }
    }
  }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = _mm512_reduce_add_ps(acc[m][i]) + off[m][i];
}
#else
#define HAVE_VNNI 0
#endif
