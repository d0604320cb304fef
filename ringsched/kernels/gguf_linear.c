/* y = x @ W^T (+ bias) with W in a GGUF quantization, block for block as the file stores it, on CPU.
 *
 * A weight row is the file's blocks of that row, one after another: Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32 values a
 * block, a float16 scale, and a float16 minimum for the _1 types), Q4_K, Q5_K and Q6_K (256 values a super-block,
 * 8 or 16 sub-block scales under a float16 one). Nothing is converted at load: the kernel reads a row's blocks
 * and turns each run of 32 values into float32 in registers (`decode32`: codes, high bits and scales), then
 * multiplies them into each activation row, for a tile of NB outputs x MB rows at a time (the weights are read
 * once per MB rows). Every output's sum is formed in the same order whatever the rows or threads, so a row's
 * result does not depend on its batch. Outputs are split over OpenMP threads (torch's own thread team: the library
 * links the same libgomp).
 *
 * With `gguf_set_integer` on (the default), other paths run where the CPU has them: for the 32-value-block types
 * below INTEGER_ROWS rows, integer dot products with int8-quantized activations (AVX512-VNNI, gguf_linear_vnni.h);
 * from AMX_ROWS rows on, AMX tiles multiplying the codes by the activations split into two bfloat16 halves, to
 * float32's accuracy (gguf_linear_amx.h); on AVX2 without AVX-512, integer dot products for every type at every
 * row count (gguf_linear_avx2dot.h).
 *
 * `gguf_dequant` writes rows as float32 (a step of many rows multiplies those with MKL; the embedding looks up its
 * rows). Built by gguf_linear.py with -O3 -march=native; AVX-512 (F, BW, VL) gets intrinsics, AVX2 with FMA keeps the
 * sums in registers, other CPUs loops.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if !HAVE_AVX512 && defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1 /* the tile's sums in 8-lane registers, Q4_0, Q4_1 and Q8_0 decoded in them */
#else
#define HAVE_AVX2 0
#endif

#define INLINE static inline __attribute__((always_inline))
#define MB 8 /* rows per tile: 8 x 2 measured 0.82x the time of 4 x 4 at 16 rows (SmolLM2's shapes, Q4_0) */
#define NB 2 /* outputs per tile */
#define INTEGER_ROWS 3 /* rows from which the float tiles beat the integer path (gguf_linear_vnni.h) */
#define AMX_ROWS 8 /* rows from which AMX tiles beat the float tiles, 2 threads (gguf_linear_amx.h) */
#define PREFETCH_BYTES 4096

/* ggml's type numbers */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

/* values and bytes of one block of `t`; 0 for a type this file does not run */
static int64_t block_values(int64_t t) { return t == Q4_K || t == Q5_K || t == Q6_K ? 256 : 32; }

static int64_t block_bytes(int64_t t) {
  switch (t) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

static inline float fp16(const uint8_t *p) { /* IEEE half at p (little-endian) as float */
  uint16_t h;
  memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#endif
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t u;
  if (exp == 0) { /* zero or subnormal: man * 2^-24 */
    const float f = (float)man * (1.0f / 16777216.0f);
    memcpy(&u, &f, 4);
    u |= sign;
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (0..7) from the 12 packed bytes q */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/* The 32 values of sub-block b (values 32b .. 32b + 31) of a row of type t at `row`, as float32: the reference
 * every path agrees with (the vector decoder computes the same products). */
__attribute__((unused)) static void decode32_scalar(const uint8_t *row, int64_t t, int64_t b, float out[32]) {
  if (block_values(t) == 32) {
    const uint8_t *p = row + b * block_bytes(t);
    const float d = fp16(p);
    if (t == Q8_0) {
      for (int j = 0; j < 32; j++) out[j] = d * (float)(int8_t)p[2 + j];
      return;
    }
    const float m = (t == Q4_1 || t == Q5_1) ? fp16(p + 2) : 0.0f;
    const uint8_t *qs = p + (t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8);
    uint32_t qh = 0;
    if (t == Q5_0 || t == Q5_1) memcpy(&qh, p + (t == Q5_0 ? 2 : 4), 4);
    const int off = t == Q4_0 ? 8 : t == Q5_0 ? 16 : 0;
    for (int j = 0; j < 16; j++) {
      int lo = qs[j] & 0xF, hi = qs[j] >> 4;
      if (t == Q5_0 || t == Q5_1) {
        lo |= (int)((qh >> j) & 1) << 4;
        hi |= (int)((qh >> (j + 16)) & 1) << 4;
      }
      out[j] = off ? d * (float)(lo - off) : d * (float)lo + m;
      out[j + 16] = off ? d * (float)(hi - off) : d * (float)hi + m;
    }
    return;
  }
  const uint8_t *p = row + (b / 8) * block_bytes(t);
  const int c = (int)(b % 8);
  if (t == Q6_K) {
    const uint8_t *ql = p + 64 * (c / 4), *qh = p + 128 + 32 * (c / 4);
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * (c / 4);
    const float d = fp16(p + 208);
    const int cc = c % 4;
    for (int l = 0; l < 32; l++) {
      const int q = ((ql[(cc & 1) * 32 + l] >> (4 * (cc >> 1))) & 0xF) | (((qh[l] >> (2 * cc)) & 3) << 4);
      out[l] = d * (float)sc[2 * cc + l / 16] * (float)(q - 32);
    }
    return;
  }
  int sc, mn;
  scale_min_k4(c, p + 4, &sc, &mn);
  const float d = fp16(p) * (float)sc, m = fp16(p + 2) * (float)mn;
  const uint8_t *qs = p + (t == Q4_K ? 16 : 48) + 32 * (c / 2);
  for (int l = 0; l < 32; l++) {
    int q = (qs[l] >> (4 * (c & 1))) & 0xF;
    if (t == Q5_K) q |= ((p[16 + l] >> c) & 1) << 4;
    out[l] = d * (float)q - m;
  }
}

#if HAVE_AVX512
/* 16 bytes' nibbles (low when shift is 0, high when 4) as 16 int32 */
INLINE __m512i nibbles(__m128i b, int shift) {
  const __m128i v = shift ? _mm_srli_epi16(b, 4) : b;
  return _mm512_cvtepu8_epi32(_mm_and_si128(v, _mm_set1_epi8(0x0f)));
}

/* sub-block b of a row of type t as two halves of 16 float32 values (lo: values 0..15, hi: 16..31) */
INLINE void decode32(const uint8_t *row, const int t, int64_t b, __m512 *lo, __m512 *hi) {
  if (t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0) {
    const uint8_t *p = row + b * (t == Q4_0 ? 18 : t == Q4_1 ? 20 : t == Q5_0 ? 22 : t == Q5_1 ? 24 : 34);
    const __m512 d = _mm512_set1_ps(fp16(p));
    if (t == Q8_0) {
      *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 2)))));
      *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(p + 18)))));
      return;
    }
    const __m128i qs = _mm_loadu_si128((const __m128i *)(p + (t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8)));
    __m512i l = nibbles(qs, 0), h = nibbles(qs, 4);
    if (t == Q5_0 || t == Q5_1) {
      uint32_t qh;
      memcpy(&qh, p + (t == Q5_0 ? 2 : 4), 4);
      const __m512i sixteen = _mm512_set1_epi32(16);
      l = _mm512_mask_add_epi32(l, (__mmask16)(qh & 0xffff), l, sixteen);
      h = _mm512_mask_add_epi32(h, (__mmask16)(qh >> 16), h, sixteen);
    }
    if (t == Q4_0 || t == Q5_0) {
      const __m512i off = _mm512_set1_epi32(t == Q4_0 ? 8 : 16);
      *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(l, off)));
      *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(h, off)));
    } else {
      const __m512 m = _mm512_set1_ps(fp16(p + 2));
      *lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(l), m);
      *hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(h), m);
    }
    return;
  }
  const uint8_t *p = row + (b / 8) * (t == Q4_K ? 144 : t == Q5_K ? 176 : 210);
  const int c = (int)(b % 8);
  if (t == Q6_K) {
    const uint8_t *ql = p + 64 * (c / 4) + (c & 1) * 32, *qh = p + 128 + 32 * (c / 4);
    const int8_t *sc = (const int8_t *)(p + 192) + 8 * (c / 4);
    const int cc = c % 4;
    const float d = fp16(p + 208);
    const __m512i thirtytwo = _mm512_set1_epi32(32), three = _mm512_set1_epi32(3);
    for (int half = 0; half < 2; half++) {
      const __m512i q4 = nibbles(_mm_loadu_si128((const __m128i *)(ql + 16 * half)), 4 * (cc >> 1));
      const __m512i h2 = _mm512_and_si512(
          _mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(qh + 16 * half))), 2 * cc), three);
      const __m512i q = _mm512_sub_epi32(_mm512_or_si512(q4, _mm512_slli_epi32(h2, 4)), thirtytwo);
      const __m512 v = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[2 * cc + half]), _mm512_cvtepi32_ps(q));
      if (half) *hi = v; else *lo = v;
    }
    return;
  }
  int sc, mn;
  scale_min_k4(c, p + 4, &sc, &mn);
  const __m512 d = _mm512_set1_ps(fp16(p) * (float)sc), m = _mm512_set1_ps(fp16(p + 2) * (float)mn);
  const uint8_t *qs = p + (t == Q4_K ? 16 : 48) + 32 * (c / 2);
  __m512i l = nibbles(_mm_loadu_si128((const __m128i *)qs), 4 * (c & 1));
  __m512i h = nibbles(_mm_loadu_si128((const __m128i *)(qs + 16)), 4 * (c & 1));
  if (t == Q5_K) {
    const __m128i bit = _mm_set1_epi8((char)(1 << c));
    const __mmask16 ml = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(p + 16)), bit);
    const __mmask16 mh = _mm_test_epi8_mask(_mm_loadu_si128((const __m128i *)(p + 32)), bit);
    l = _mm512_mask_add_epi32(l, ml, l, _mm512_set1_epi32(16));
    h = _mm512_mask_add_epi32(h, mh, h, _mm512_set1_epi32(16));
  }
  *lo = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(l), m);
  *hi = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(h), m);
}

INLINE __m512 load_x16(const void *p, const int xb) {
  if (xb) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
  return _mm512_loadu_ps(p);
}
#endif

static inline float load_act(const void *x, int xb, int64_t i) {
  if (!xb) return ((const float *)x)[i];
  const uint32_t u = (uint32_t)((const uint16_t *)x)[i] << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static inline void store_out(void *y, int yb, int64_t i, float v) {
  if (!yb) {
    ((float *)y)[i] = v;
    return;
  }
  uint32_t u;
  memcpy(&u, &v, 4);
  ((uint16_t *)y)[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40)
                                                        : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if HAVE_AVX2
INLINE __m256 load_x8(const char *p, const int xb) {
  return xb ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16))
            : _mm256_loadu_ps((const float *)p);
}

/* The 32 values of block b of a Q4_0, Q4_1 or Q8_0 row as float32 in v[0..3] (values 0-7, 8-15, 16-23, 24-31), the
 * products decode32_scalar forms; other types through it */
INLINE void decode32_avx2(const uint8_t *row, const int64_t t, int64_t b, __m256 v[4]) {
  if (t != Q4_0 && t != Q4_1 && t != Q8_0) {
    float f[32];
    decode32_scalar(row, t, b, f);
    for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(f + 8 * j);
    return;
  }
  const uint8_t *p = row + b * block_bytes(t);
  const __m256 d = _mm256_set1_ps(fp16(p));
  if (t == Q8_0) {
    for (int j = 0; j < 4; j++)
      v[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(p + 2 + 8 * j)))));
    return;
  }
  const __m128i q = _mm_loadu_si128((const __m128i *)(p + (t == Q4_0 ? 2 : 4))), mask = _mm_set1_epi8(0x0f);
  const __m128i half[2] = {_mm_and_si128(q, mask), _mm_and_si128(_mm_srli_epi16(q, 4), mask)};
  for (int j = 0; j < 4; j++) {
    const __m128i h = half[j / 2];
    v[j] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(j % 2 ? _mm_srli_si128(h, 8) : h));
  }
  if (t == Q4_0)
    for (int j = 0; j < 4; j++) v[j] = _mm256_mul_ps(d, _mm256_sub_ps(v[j], _mm256_set1_ps(8.0f)));
  else
    for (int j = 0; j < 4; j++) v[j] = _mm256_fmadd_ps(d, v[j], _mm256_set1_ps(fp16(p + 2)));
}

/* The 8 lanes added in a fixed order */
INLINE float sum8(__m256 v) {
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
#elif !HAVE_AVX512
/* One row's 16 lanes += its 32 activations of block `b` times the block's values `v`, and the lanes' sum. Not
 * inlined: the tile's constant row count would let the compiler vectorize (and, with -ffast-math, reassociate)
 * each copy its own way, and a row's result would then depend on how many rows shared its tile. */
__attribute__((noinline)) static void lanes_add(float *lanes, const char *xr, const int xb, int64_t b,
                                                const float *v) {
  for (int l = 0; l < 16; l++) {
    lanes[l] += load_act(xr, xb, 32 * b + l) * v[l];
    lanes[l] += load_act(xr, xb, 32 * b + 16 + l) * v[16 + l];
  }
}

__attribute__((noinline)) static float lanes_sum(const float *lanes) {
  float s = 0.0f;
  for (int l = 0; l < 16; l++) s += lanes[l];
  return s;
}
#endif

/* Sums of a tile of `nb` outputs x `mb` rows (16 lanes each, reduced at the end); inlined with constant t, mb, xb */
INLINE void tile(const void *x, int64_t ldx, const int xb, int64_t m0, const int mb, int64_t K, const uint8_t *w,
                 int64_t row_bytes, const int t, int64_t n0, int64_t nb, float acc_out[MB][NB]) {
  const uint8_t *wr[NB];
  const char *xr[MB];
  const int64_t xsize = xb ? 2 : 4;
  for (int i = 0; i < NB; i++) wr[i] = w + (n0 + (i < nb ? i : 0)) * row_bytes;
  for (int m = 0; m < mb; m++) xr[m] = (const char *)x + (m0 + m) * ldx * xsize;
#if HAVE_AVX512
  __m512 acc[MB][NB];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc[m][i] = _mm512_setzero_ps();
  const int64_t per = row_bytes / (K / 32); /* bytes per 32 values, rounded down: a prefetch distance only */
  for (int64_t b = 0; b < K / 32; b++) {
    __m512 lo[NB], hi[NB];
    for (int i = 0; i < NB; i++) {
      decode32(wr[i], t, b, &lo[i], &hi[i]);
      if ((b & 3) == 0) _mm_prefetch((const char *)wr[i] + b * per + PREFETCH_BYTES, _MM_HINT_T0);
    }
    for (int m = 0; m < mb; m++) {
      const __m512 xl = load_x16(xr[m] + xsize * 32 * b, xb), xh = load_x16(xr[m] + xsize * (32 * b + 16), xb);
      for (int i = 0; i < NB; i++) acc[m][i] = _mm512_fmadd_ps(xh, hi[i], _mm512_fmadd_ps(xl, lo[i], acc[m][i]));
    }
  }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = _mm512_reduce_add_ps(acc[m][i]);
#elif HAVE_AVX2 /* 16 lanes as two registers: lanes l and 8 + l take values l and 16 + l, then 8 + l and 24 + l */
  __m256 acc[MB][NB][2];
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc[m][i][0] = acc[m][i][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; b++)
    for (int i = 0; i < NB; i++) {
      __m256 v[4];
      decode32_avx2(wr[i], t, b, v);
      const __m256 v0 = v[0], v1 = v[1], v2 = v[2], v3 = v[3];
      for (int m = 0; m < mb; m++) {
        const char *p = xr[m] + xsize * 32 * b;
        acc[m][i][0] = _mm256_fmadd_ps(load_x8(p + xsize * 16, xb), v2, _mm256_fmadd_ps(load_x8(p, xb), v0, acc[m][i][0]));
        acc[m][i][1] = _mm256_fmadd_ps(load_x8(p + xsize * 24, xb), v3,
                                       _mm256_fmadd_ps(load_x8(p + xsize * 8, xb), v1, acc[m][i][1]));
      }
    }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = sum8(_mm256_add_ps(acc[m][i][0], acc[m][i][1]));
#else
  float lanes[MB][NB][16] = {{{0}}};
  for (int64_t b = 0; b < K / 32; b++)
    for (int i = 0; i < NB; i++) {
      float v[32];
      decode32_scalar(wr[i], t, b, v);
      for (int m = 0; m < mb; m++) lanes_add(lanes[m][i], xr[m], xb, b, v);
    }
  for (int m = 0; m < mb; m++)
    for (int i = 0; i < NB; i++) acc_out[m][i] = lanes_sum(lanes[m][i]);
#endif
}

#define TILE_MB(T, XB)                                                                                         \
  do {                                                                                                         \
    switch (mb) {                                                                                              \
      case 8: tile(x, ldx, XB, m0, 8, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 7: tile(x, ldx, XB, m0, 7, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 6: tile(x, ldx, XB, m0, 6, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 5: tile(x, ldx, XB, m0, 5, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 4: tile(x, ldx, XB, m0, 4, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 3: tile(x, ldx, XB, m0, 3, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      case 2: tile(x, ldx, XB, m0, 2, K, w, row_bytes, T, n0, nb, acc); break;                                 \
      default: tile(x, ldx, XB, m0, 1, K, w, row_bytes, T, n0, nb, acc);                                       \
    }                                                                                                          \
  } while (0)

#define TILE_T(T)                                                                                              \
  case T:                                                                                                      \
    if (x_bf16) TILE_MB(T, 1); else TILE_MB(T, 0);                                                             \
    break

/* One activation row quantized to int8 per block of 32, for the integer paths (as llama.cpp does): codes q, the
 * same + 128 as unsigned u (VNNI's Q8_0; NULL where unused), per block a scale d (max|x| / 127) and d * (the sum
 * of its codes) s, and per 16 values d * (the sum of their codes) s16 (NULL where unused). */
typedef struct {
  int8_t *q;
  uint8_t *u;
  float *d, *s, *s16;
} xrow_t;

__attribute__((unused)) static void quantize_row(const void *x, int xb, int64_t K, xrow_t *r) {
  for (int64_t b = 0; b < K / 32; b++) {
    float v[32], amax = 0.0f;
    for (int j = 0; j < 32; j++) {
      v[j] = load_act(x, xb, 32 * b + j);
      const float a = v[j] < 0 ? -v[j] : v[j];
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    int sum[2] = {0, 0};
    for (int j = 0; j < 32; j++) {
      const int q = (int)__builtin_roundf(v[j] * id);
      r->q[32 * b + j] = (int8_t)q;
      if (r->u) r->u[32 * b + j] = (uint8_t)(q + 128);
      sum[j / 16] += q;
    }
    r->d[b] = d;
    r->s[b] = d * (float)(sum[0] + sum[1]);
    if (r->s16) {
      r->s16[2 * b] = d * (float)sum[0];
      r->s16[2 * b + 1] = d * (float)sum[1];
    }
  }
}

#include "gguf_linear_vnni.h"
#include "gguf_linear_avx2dot.h"
#include "gguf_linear_amx.h"

static int integer_path = 1; /* gguf_set_integer: the VNNI and AMX paths where they run (tests compare them all) */

void gguf_set_integer(int64_t on) { integer_path = (int)on; }

/* 1: the VNNI path (the 32-value-block types, below INTEGER_ROWS rows); 2: the AVX2 one (every type, every row
 * count); 0: none */
int gguf_has_integer(void) { return HAVE_VNNI ? 1 : HAVE_AVX2DOT ? 2 : 0; }

int gguf_has_amx(void) { /* 1 where the tile path runs (built for AMX tiles and bfloat16, permitted by the kernel) */
#if HAVE_AMX
  return amx_permitted();
#else
  return 0;
#endif
}

#if HAVE_VNNI
#define VNNI_MB(T)                                                                                             \
  case T:                                                                                                      \
    switch (mb) {                                                                                              \
      case 8: tile_vnni(xr, m0, 8, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 7: tile_vnni(xr, m0, 7, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 6: tile_vnni(xr, m0, 6, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 5: tile_vnni(xr, m0, 5, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 4: tile_vnni(xr, m0, 4, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 3: tile_vnni(xr, m0, 3, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      case 2: tile_vnni(xr, m0, 2, K, w, row_bytes, T, n0, nb, acc); break;                                    \
      default: tile_vnni(xr, m0, 1, K, w, row_bytes, T, n0, nb, acc);                                          \
    }                                                                                                          \
    break

/* gguf_linear by integer dot products (gguf_linear_vnni.h); 2 when the activations' buffer cannot be had */
static int linear_vnni(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w,
                       int64_t type, int64_t N, const float *bias, void *y, int64_t ldy, int64_t y_bf16,
                       int64_t nthreads) {
  const int64_t row_bytes = K / 32 * block_bytes(type), tiles = (N + NB - 1) / NB;
  char *buf = malloc((size_t)M * (size_t)(2 * K + 2 * (K / 32) * (int64_t)sizeof(float)));
  xrow_t *xr = malloc((size_t)M * sizeof(xrow_t));
  if (!buf || !xr) {
    free(buf);
    free(xr);
    return 2;
  }
  for (int64_t m = 0; m < M; m++) {
    char *p = buf + m * (2 * K + 2 * (K / 32) * (int64_t)sizeof(float));
    xr[m] = (xrow_t){(int8_t *)p, (uint8_t *)(p + K), (float *)(p + 2 * K), (float *)(p + 2 * K) + K / 32, NULL};
    quantize_row((const char *)x + m * ldx * (x_bf16 ? 2 : 4), (int)x_bf16, K, &xr[m]);
  }
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t ti = 0; ti < tiles; ti++) {
    const int64_t n0 = ti * NB, nb = N - n0 < NB ? N - n0 : NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = M - m0 < MB ? M - m0 : MB;
      float acc[MB][NB];
      switch (type) {
        VNNI_MB(Q4_0);
        VNNI_MB(Q4_1);
        VNNI_MB(Q5_0);
        VNNI_MB(Q5_1);
        VNNI_MB(Q8_0);
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
#endif

/* y[m * ldy + n] = x[m] . row n of w (+ bias[n]) for n < N. Returns 0, or 1 for a type it does not run or a K that
 * is not a whole number of blocks. */
static int linear_into(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w,
                       int64_t type, int64_t N, const float *bias, void *y, int64_t ldy, int64_t y_bf16,
                       int64_t nthreads) {
  if (!block_bytes(type) || K % block_values(type)) return 1;
  const int64_t row_bytes = K / block_values(type) * block_bytes(type), tiles = (N + NB - 1) / NB;
  if (nthreads > tiles) nthreads = tiles;
  if (nthreads < 1) nthreads = 1;
#if HAVE_AMX /* from AMX_ROWS rows on, tiles of 16 outputs x 16 rows (where the kernel lets this process use them) */
  if (integer_path && M >= AMX_ROWS && block_values(type) == 32 &&
      linear_amx(x, ldx, x_bf16, M, K, w, type, N, bias, y, ldy, y_bf16, nthreads) == 0)
    return 0;
#endif
#if HAVE_VNNI
  /* at a few rows the integer path's cheaper decoding wins; from INTEGER_ROWS on, the float tiles' cheaper
   * per-row work does (decoding is shared by a tile's MB rows) */
  if (integer_path && M < INTEGER_ROWS && block_values(type) == 32 && (K / 32) % 2 == 0 &&
      linear_vnni(x, ldx, x_bf16, M, K, w, type, N, bias, y, ldy, y_bf16, nthreads) == 0)
    return 0;
#endif
#if HAVE_AVX2DOT
  if (integer_path && linear_dot(x, ldx, x_bf16, M, K, w, type, N, bias, y, ldy, y_bf16, nthreads) == 0) return 0;
#endif
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1)
  for (int64_t ti = 0; ti < tiles; ti++) {
    const int64_t n0 = ti * NB, nb = N - n0 < NB ? N - n0 : NB;
    for (int64_t m0 = 0; m0 < M; m0 += MB) {
      const int64_t mb = M - m0 < MB ? M - m0 : MB;
      float acc[MB][NB];
      switch (type) {
        TILE_T(Q4_0);
        TILE_T(Q4_1);
        TILE_T(Q5_0);
        TILE_T(Q5_1);
        TILE_T(Q8_0);
        TILE_T(Q4_K);
        TILE_T(Q5_K);
        TILE_T(Q6_K);
      }
      for (int64_t m = 0; m < mb; m++)
        for (int64_t i = 0; i < nb; i++)
          store_out(y, (int)y_bf16, (m0 + m) * ldy + n0 + i, acc[m][i] + (bias ? bias[n0 + i] : 0.0f));
    }
  }
  return 0;
}

int gguf_linear(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w, int64_t type,
                int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  return linear_into(x, ldx, x_bf16, M, K, w, type, N, bias, y, N, y_bf16, nthreads);
}

/* Projections of different types side by side (q/k/v whose types differ): `parts` holds (weight address, type,
 * outputs) for each of `nparts`; each part's outputs land in y's columns after the previous parts'. */
int gguf_linear_parts(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const int64_t *parts,
                      int64_t nparts, const float *bias, void *y, int64_t y_bf16, int64_t nthreads) {
  int64_t N = 0, col = 0;
  for (int64_t p = 0; p < nparts; p++) N += parts[3 * p + 2];
  for (int64_t p = 0; p < nparts; p++) {
    const int64_t n = parts[3 * p + 2];
    char *yp = (char *)y + col * (y_bf16 ? 2 : 4);
    const int rc = linear_into(x, ldx, x_bf16, M, K, (const uint8_t *)parts[3 * p], parts[3 * p + 1], n,
                               bias ? bias + col : NULL, yp, N, y_bf16, nthreads);
    if (rc) return rc;
    col += n;
  }
  return 0;
}

/* rows x K values of type `type` at w (rows of row_bytes) as float32 into out [rows, K]; 0, or 1 as above */
int gguf_dequant(const uint8_t *w, int64_t type, int64_t rows, int64_t K, float *out, int64_t nthreads) {
  if (!block_bytes(type) || K % block_values(type)) return 1;
  const int64_t row_bytes = K / block_values(type) * block_bytes(type);
  if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nthreads > 1 && rows > 1)
  for (int64_t r = 0; r < rows; r++)
    for (int64_t b = 0; b < K / 32; b++) {
#if HAVE_AVX512
      __m512 lo, hi;
      switch (type) { /* the vector decoder, inlined per type */
        case Q4_0: decode32(w + r * row_bytes, Q4_0, b, &lo, &hi); break;
        case Q4_1: decode32(w + r * row_bytes, Q4_1, b, &lo, &hi); break;
        case Q5_0: decode32(w + r * row_bytes, Q5_0, b, &lo, &hi); break;
        case Q5_1: decode32(w + r * row_bytes, Q5_1, b, &lo, &hi); break;
        case Q8_0: decode32(w + r * row_bytes, Q8_0, b, &lo, &hi); break;
        case Q4_K: decode32(w + r * row_bytes, Q4_K, b, &lo, &hi); break;
        case Q5_K: decode32(w + r * row_bytes, Q5_K, b, &lo, &hi); break;
        default: decode32(w + r * row_bytes, Q6_K, b, &lo, &hi); break;
      }
      _mm512_storeu_ps(out + r * K + 32 * b, lo);
      _mm512_storeu_ps(out + r * K + 32 * b + 16, hi);
#else
      decode32_scalar(w + r * row_bytes, type, b, out + r * K + 32 * b);
#endif
    }
  return 0;
}

int gguf_block_bytes(int64_t type) { return (int)block_bytes(type); }
int gguf_block_values(int64_t type) { return block_bytes(type) ? (int)block_values(type) : 0; }
