/* gguf_linear.c's path for many rows (AMX_ROWS on; included by it), where the CPU has AMX (tiles, bfloat16 products):
 * the 32-value-block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) multiplied by tile instructions, to float32's accuracy.
 *
 * A block's codes are small integers, exact in bfloat16; an activation x is split into two bfloat16 halves,
 * hi = bf16(x) and lo = bf16(x - hi), which hold it to within 2^-18 of itself. `tdpbf16ps` multiplies pairs exactly
 * and sums them in float32, so a block's sum is the float path's to float32 rounding (the int8 activations of
 * llama.cpp and of the VNNI path, one code of 255 steps a block, flipped greedy tokens against the dequantized
 * weights where logits were near ties). It computes y^T = W . x^T, 16 outputs x 16 rows a tile, a block at a time:
 *   A (tile 2 or 3): 16 weight rows x the 32 codes of block b as bfloat16 (64 bytes a row), unpacked once per 16
 *     outputs for every block (`weight_codes`): Q8_0's as they are, Q4_0's code - 8, Q5_0's code - 16, the _1
 *     types' as they are (0..31);
 *   B (tiles 4, 5 or 6, 7): block b of 16 activation rows, hi and lo, each in the bfloat16 VNNI layout, 16 rows of
 *     64 bytes: row r holds, for each activation row m, its values 2r and 2r + 1 (`pack_tile`, once per call);
 *   C (tile 0 or 1): C[n][m] = sum over the block of code[n][k] * (hi[m][k] + lo[m][k]), two `tdpbf16ps`.
 * Weight scales differ per block, so C is stored after each block and added into float accumulators, 16 vectors
 * (one per output n, lanes = the 16 rows) kept in registers over the row's blocks:
 *   acc[n] = fma(C[n], dw[n][b], acc[n])     then, for the _1 types' minimum,
 *   acc[n] = fma(mw[n][b], sx[b], acc[n])    (sx: the block's activation sum, in float32).
 * Block b + 1's multiplies are issued before block b's float work, on the other set of tiles. Every output's sum
 * is formed in block order by the same lane arithmetic whatever its row, the other rows, their number, the outputs
 * and the threads, so a row's result does not depend on the rows it shares a step with. Rows past M are packed as
 * zeros, outputs past N as zero codes; neither is written out. Many rows go in runs (`linear_amx`), so that the
 * packed activations, read again for every 16 outputs, stay in L2.
 *
 * Tiles need the kernel's permission (arch_prctl ARCH_REQ_XCOMP_PERM, per process, asked once); without it the
 * callers take the other paths. Each OpenMP thread loads the tile configuration at the start of the parallel
 * region and releases the tiles at its end.
 */

#if HAVE_AVX512 && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#else
#define omp_get_thread_num() 0
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define AMX_TILE 1024 /* bytes of one tile of operands: 16 rows of 64 */
#define AMX_X_BYTES (1 << 20) /* packed activations at most, a run of rows (L2: 2 MiB a core here) */

/* palette 1, eight tiles of 16 rows x 64 bytes (C: 16 float32 a row; A, B: 32 bfloat16): the 64-byte layout is
 * the palette's byte, 15 reserved, 16 two-byte row widths, 16 row counts */
static void amx_configure(void) {
  uint8_t c[64] __attribute__((aligned(64))) = {1};
  for (int i = 0; i < 8; i++) {
    c[16 + 2 * i] = 64;
    c[48 + i] = 16;
  }
  _tile_loadconfig(c);
}

/* 0, k, 2k, .. 15k */
INLINE __m512i lanes_times(int k) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(k));
}

/* the outputs of n0 .. n0 + 15 below N */
INLINE __mmask16 outputs_below(int64_t n0, int64_t N) {
  return N - n0 >= 16 ? 0xffff : (__mmask16)((1u << (N - n0)) - 1);
}

static int amx_state = -1; /* -1: not asked yet; 0: refused; 1: granted */

static int amx_permitted(void) {
  int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
  if (s < 0) { /* two threads asking at once both get the same answer */
    s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
  }
  return s;
}

/* Activations packed: per group of 16 rows g and block b (i = g * nblk + b), the hi tile at tiles + 2 i AMX_TILE,
 * the lo tile after it, and the 16 rows' block sums at s + 16 i */
typedef struct {
  uint16_t *tiles;
  float *s;
} amx_x_t;

/* block b of row 16 g + lane (at x) split into bfloat16 hi and lo, into its lane of the tiles */
INLINE void pack_block(const void *x, int xb, int64_t i, int lane, const amx_x_t *px) {
  const __m512i rows = lanes_times(16); /* 64 bytes apart, in dwords */
  const __m512 v0 = load_x16(x, xb), v1 = load_x16((const char *)x + (xb ? 32 : 64), xb);
  const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(v1, v0); /* values 0..31 in order: a dword holds 2k, 2k + 1 */
  const __m512 h0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
  const __m512 h1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
  const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(v1, h1), _mm512_sub_ps(v0, h0));
  uint16_t *t = px->tiles + 2 * i * (AMX_TILE / 2) + 2 * lane;
  _mm512_i32scatter_epi32(t, rows, hi, 4);
  _mm512_i32scatter_epi32(t + AMX_TILE / 2, rows, lo, 4);
  px->s[16 * i + lane] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
}

/* tile i (group i / nblk, block i % nblk) of x's M rows; rows past M as zeros */
static void pack_tile(const void *x, int64_t ldx, int xb, int64_t M, int64_t nblk, int64_t i, const amx_x_t *px) {
  const int64_t g = i / nblk, b = i % nblk, rows = M - 16 * g < 16 ? M - 16 * g : 16;
  if (rows < 16) {
    memset(px->tiles + 2 * i * (AMX_TILE / 2), 0, 2 * AMX_TILE);
    memset(px->s + 16 * i, 0, 16 * sizeof(float));
  }
  for (int lane = 0; lane < rows; lane++)
    pack_block((const char *)x + ((16 * g + lane) * ldx + 32 * b) * (xb ? 2 : 4), xb, i, lane, px);
}

/* Weights of 16 outputs: block b's codes as bfloat16 (a tile A) at codes + b * AMX_TILE / 2, the scales dw and
 * minimums mw (0 but for the _1 types) at b * 16 + n */
typedef struct {
  uint16_t *codes;
  float *dw, *mw;
} amx_w_t;

/* the codes of one block of type t (not Q8_0) in 4 rows from p (row_bytes apart), as stored (0..15, 0..31 with
 * the fifth bit), each row's 32 in value order: 128 bytes at out */
INLINE void codes4(const uint8_t *p, int64_t row_bytes, const int t, int8_t *out) {
  const int qo = t == Q4_0 ? 2 : t == Q4_1 ? 4 : t == Q5_0 ? 6 : 8;
  __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(p + qo)));
  for (int r = 1; r < 4; r++)
    q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i *)(p + r * row_bytes + qo)), r);
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i lo = _mm512_and_si512(q, mask), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), mask);
  for (int h = 0; h < 2; h++) { /* rows 2h, 2h + 1: their low nibbles then high ones */
    const __m512i order = h ? _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15)
                            : _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11); /* 16-byte quarters */
    __m512i c = _mm512_permutex2var_epi64(lo, order, hi);
    if (t == Q5_0 || t == Q5_1) { /* the fifth bits, bit j of a row's 32 for its value j */
      uint32_t h0, h1;
      memcpy(&h0, p + 2 * h * row_bytes + qo - 4, 4);
      memcpy(&h1, p + (2 * h + 1) * row_bytes + qo - 4, 4);
      c = _mm512_mask_add_epi8(c, (__mmask64)h0 | (__mmask64)h1 << 32, c, _mm512_set1_epi8(16));
    }
    _mm512_storeu_si512(out + 64 * h, c);
  }
}

/* block b's scales dw and minimums mw (0 but for the _1 types) of outputs n0 .. n0 + 15 (0 past N) into pw */
INLINE void weight_scales(const uint8_t *w, int64_t row_bytes, const int t, int64_t n0, int64_t N, int64_t nblk,
                          const amx_w_t *pw) {
  const int64_t bb = block_bytes(t);
  const __mmask16 real = outputs_below(n0, N);
  const __m512i rows = lanes_times((int)row_bytes);
  for (int64_t b = 0; b < nblk; b++) { /* each row's first dword of block b: scale (low half), minimum (high) */
    const __m512i h = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, rows, w + n0 * row_bytes + b * bb, 1);
    _mm512_storeu_ps(pw->dw + 16 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
    _mm512_storeu_ps(pw->mw + 16 * b, t == Q4_1 || t == Q5_1
                                          ? _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(h, 16)))
                                          : _mm512_setzero_ps());
  }
}

/* 32 codes as 32 bfloat16 (exact) at out: Q8_0's signed, the others' looked up in `values` (bfloat16 of code -
 * offset, for the 32 codes) */
INLINE void codes_bf16(__m256i q, const int t, __m512i values, uint16_t *out) {
  if (t != Q8_0) {
    _mm512_store_si512(out, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), values));
    return;
  }
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
  _mm512_store_si512(out, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* the codes of outputs n0 .. n0 + 15 (zeros past N) as bfloat16 tiles into pw, 4 rows at a time along the rows */
INLINE void weight_codes(const uint8_t *w, int64_t row_bytes, const int t, int64_t n0, int64_t N, int64_t nblk,
                         const amx_w_t *pw) {
  const int64_t bb = block_bytes(t);
  const __m512 code = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 off = _mm512_set1_ps(t == Q4_0 ? 8.0f : t == Q5_0 ? 16.0f : 0.0f); /* Q4_0: code - 8, Q5_0: - 16 */
  const __m512i values = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(_mm512_add_ps(code, _mm512_set1_ps(16.0f)), off),
                                                      _mm512_sub_ps(code, off));
  for (int64_t n = 0; n < 16; n += 4) {
    const uint8_t *p = w + (n0 + n) * row_bytes;
    for (int64_t b = 0; b < nblk; b++, p += bb) {
      int8_t c[4][32] __attribute__((aligned(64))); /* 4 rows' codes of block b (not Q8_0's) */
      const int whole = n0 + n + 4 <= N;
      if (t != Q8_0 && whole) codes4(p, row_bytes, t, c[0]);
      for (int64_t r = 0; r < 4; r++) {
        __m256i q = _mm256_setzero_si256(); /* past N: zeros */
        if (t == Q8_0 && n0 + n + r < N) q = _mm256_loadu_si256((const __m256i *)(p + r * row_bytes + 2));
        if (t != Q8_0 && whole) q = _mm256_load_si256((const __m256i *)c[r]);
        if (t != Q8_0 && !whole && n0 + n + r < N) { /* near N a row alone (its block read 4 times) */
          codes4(p + r * row_bytes, 0, t, c[0]);
          q = _mm256_load_si256((const __m256i *)c[0]);
        }
        codes_bf16(q, t, values, pw->codes + b * (AMX_TILE / 2) + 32 * (n + r));
      }
    }
  }
}

/* C tile `ct` of block b (its multiplies issued) into acc: acc[n] += C[n] * dw[b][n] (+ mw[b][n] * sx[b]) */
#define AMX_ACCUMULATE(ct, b)                                                                                  \
  do {                                                                                                         \
    float *c = cbuf[ct];                                                                                       \
    _tile_stored(ct, c, 64);                                                                                   \
    const __m512 sx = _mm512_loadu_ps(xs + (b) * 16);                                                          \
    _Pragma("GCC unroll 16") for (int n = 0; n < 16; n++) {                                                    \
      acc[n] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * n), _mm512_set1_ps(pw->dw[(b) * 16 + n]), acc[n]);     \
      if (with_min) acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(pw->mw[(b) * 16 + n]), sx, acc[n]);                \
    }                                                                                                          \
  } while (0)

/* block b of 16 outputs (tiles A `at`, C `ct`) times group g's rows (tiles B `bh`, `bl`): its multiplies issued */
#define AMX_STEP(ct, at, bh, bl, b)                                                                            \
  do {                                                                                                         \
    _tile_loadd(at, pw->codes + (b) * (AMX_TILE / 2), 64);                                                     \
    _tile_loadd(bh, xt + 2 * (b) * (AMX_TILE / 2), 64);                                                        \
    _tile_loadd(bl, xt + (2 * (b) + 1) * (AMX_TILE / 2), 64);                                                  \
    _tile_zero(ct);                                                                                            \
    _tile_dpbf16ps(ct, at, bh);                                                                                \
    _tile_dpbf16ps(ct, at, bl);                                                                                \
  } while (0)

/* out[n][m] = the sum of output n of `pw` with row 16 g + m, over all blocks (acc[n]: lanes m, in registers). Block
 * b + 1's multiplies are issued before block b's float work (tiles 0, 2, 4, 5 for even blocks, 1, 3, 6, 7 for odd
 * ones). */
INLINE void amx_tile(const amx_w_t *pw, const amx_x_t *px, int64_t g, int64_t nblk, const int with_min,
                     float out[16][16]) {
  float cbuf[2][256] __attribute__((aligned(64)));
  __m512 acc[16];
#pragma GCC unroll 16
  for (int n = 0; n < 16; n++) acc[n] = _mm512_setzero_ps();
  const uint16_t *xt = px->tiles + 2 * g * nblk * (AMX_TILE / 2);
  const float *xs = px->s + g * nblk * 16;
  AMX_STEP(0, 2, 4, 5, 0);
  for (int64_t b = 0; b < nblk; b += 2) {
    if (b + 1 < nblk) AMX_STEP(1, 3, 6, 7, b + 1);
    AMX_ACCUMULATE(0, b);
    if (b + 1 == nblk) break;
    if (b + 2 < nblk) AMX_STEP(0, 2, 4, 5, b + 2);
    AMX_ACCUMULATE(1, b + 1);
  }
#pragma GCC unroll 16
  for (int n = 0; n < 16; n++) _mm512_storeu_ps(out[n], acc[n]);
}

/* v as bfloat16, rounded as `store_out` rounds (to nearest even; a NaN kept quiet) */
INLINE __m256i to_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v), hi = _mm512_srli_epi32(u, 16);
  const __m512i even = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i r = _mm512_mask_or_epi32(_mm512_srli_epi32(_mm512_add_epi32(u, even), 16), nan, hi,
                                         _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(r);
}

/* out[n][m] (output n0 + n, row 16 g + m) + bias into y, for the outputs below N and rows below M */
INLINE void amx_store(const float out[16][16], int64_t n0, int64_t N, int64_t g, int64_t M, const float *bias,
                      void *y, int64_t ldy, int y_bf16) {
  const __mmask16 real = outputs_below(n0, N);
  const __m512i column = lanes_times(16);
  const __m512 b = bias ? _mm512_maskz_loadu_ps(real, bias + n0) : _mm512_setzero_ps();
  for (int64_t m = 0; m < 16 && 16 * g + m < M; m++) {
    const __m512 v = _mm512_add_ps(_mm512_i32gather_ps(column, &out[0][m], 4), b);
    const int64_t at = (16 * g + m) * ldy + n0;
    if (y_bf16) _mm256_mask_storeu_epi16((uint16_t *)y + at, real, to_bf16(v));
    else _mm512_mask_storeu_ps((float *)y + at, real, v);
  }
}

/* outputs n0 .. n0 + 15 for every row, `scratch` holding their codes and scales: inlined per type */
INLINE void amx_outputs(const uint8_t *w, int64_t row_bytes, const int t, int64_t n0, int64_t N, int64_t M,
                        int64_t nblk, char *scratch, const amx_x_t *px, const float *bias, void *y, int64_t ldy,
                        int y_bf16) {
  float *scales = (float *)(scratch + nblk * AMX_TILE);
  const amx_w_t pw = {(uint16_t *)scratch, scales, scales + 16 * nblk};
  weight_scales(w, row_bytes, t, n0, N, nblk, &pw);
  weight_codes(w, row_bytes, t, n0, N, nblk, &pw);
  for (int64_t g = 0; g < (M + 15) / 16; g++) {
    float out[16][16] __attribute__((aligned(64)));
    amx_tile(&pw, px, g, nblk, t == Q4_1 || t == Q5_1, out);
    amx_store(out, n0, N, g, M, bias, y, ldy, y_bf16);
  }
}

#define AMX_TYPE(T)                                                                                            \
  case T: amx_outputs(w, row_bytes, T, 16 * ti, N, M, nblk, mine, &px, bias, y, ldy, (int)y_bf16); break

/* linear_amx for rows that fit in one packing */
static int linear_amx_rows(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w,
                           int64_t type, int64_t N, const float *bias, void *y, int64_t ldy, int64_t y_bf16,
                           int64_t nthreads) {
  const int64_t nblk = K / 32, groups = (M + 15) / 16, tiles = (N + 15) / 16, row_bytes = nblk * block_bytes(type);
  const int64_t wbytes = nblk * (AMX_TILE + 32 * (int64_t)sizeof(float)); /* a thread's codes, dw and mw */
  if (nthreads > tiles) nthreads = tiles;
  if (nthreads < 1) nthreads = 1;
  const size_t xt = (size_t)(groups * nblk);
  amx_x_t px = {aligned_alloc(64, xt * 2 * AMX_TILE), aligned_alloc(64, xt * 16 * sizeof(float))};
  char *scratch = aligned_alloc(64, (size_t)(nthreads * wbytes));
  if (!px.tiles || !px.s || !scratch) {
    free(px.tiles), free(px.s), free(scratch);
    return 2;
  }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
  {
    char *mine = scratch + (int64_t)omp_get_thread_num() * wbytes;
    amx_configure();
#pragma omp for schedule(static) /* whole tiles a thread: rows of one tile share its cache lines */
    for (int64_t i = 0; i < groups * nblk; i++) pack_tile(x, ldx, (int)x_bf16, M, nblk, i, &px);
#pragma omp for schedule(static)
    for (int64_t ti = 0; ti < tiles; ti++) {
      switch (type) {
        AMX_TYPE(Q4_0);
        AMX_TYPE(Q4_1);
        AMX_TYPE(Q5_0);
        AMX_TYPE(Q5_1);
        AMX_TYPE(Q8_0);
      }
    }
    _tile_release();
  }
  free(px.tiles), free(px.s), free(scratch);
  return 0;
}

/* gguf_linear by tiles, for the 32-value-block types; 2 when its buffers cannot be had or the tiles not used. Rows
 * go in runs whose packed activations (2 KiB a block of 16 rows), which every 16 outputs read again, fit in about
 * AMX_X_BYTES: a SmolLM2 layer's projections took 2.9x as long at 1024 rows in one run as at 512, 2.0x in runs. */
static int linear_amx(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const uint8_t *w,
                      int64_t type, int64_t N, const float *bias, void *y, int64_t ldy, int64_t y_bf16,
                      int64_t nthreads) {
  if (!amx_permitted()) return 2;
  const int64_t groups = AMX_X_BYTES / (K / 32 * 2 * AMX_TILE), run = 16 * (groups > 1 ? groups : 1);
  for (int64_t m0 = 0; m0 < M; m0 += run) {
    const int rc = linear_amx_rows((const char *)x + m0 * ldx * (x_bf16 ? 2 : 4), ldx, x_bf16,
                                   M - m0 < run ? M - m0 : run, K, w, type, N, bias,
                                   (char *)y + m0 * ldy * (y_bf16 ? 2 : 4), ldy, y_bf16, nthreads);
    if (rc) return rc;
  }
  return 0;
}
#else
#define HAVE_AMX 0
#endif
