/* The elementwise work of a decoder layer in one call each, for CPU steps of a few rows.
 *
 * At one decode row PyTorch spends more time dispatching a layer's small operators (the residual add and
 * RMSNorm, rotary embedding, the KV cache writes, SiLU and the gate product: ~100 operator calls a layer) than
 * computing them. These functions do the same arithmetic in the same order per element as the torch path in
 * `llama.py` (float32 throughout; bfloat16 rounded after each operation as torch rounds), compiled without
 * -ffast-math and with FMA contraction off, so the results are bit for bit torch's; the one exception is the
 * sum of squares in RMSNorm, whose order differs from torch's reduction (a last-bit difference).
 * Built by ringsched/kernels/layer_ops.py.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float bf(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint16_t to_bf(float f) { /* round to nearest even, as torch */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float rnd(float v, int b) { return b ? bf(to_bf(v)) : v; }
static inline float ld(const void *p, int b, int64_t i) { return b ? bf(((const uint16_t *)p)[i]) : ((const float *)p)[i]; }
static inline void st(void *p, int b, int64_t i, float v) {
  if (b)
    ((uint16_t *)p)[i] = to_bf(v);
  else
    ((float *)p)[i] = v;
}

/* residual += x (unless `first`: the residual is x itself); out = w * (r * rsqrt(mean(r^2) + eps)).
 * Rows of `n` elements; x, residual, out and w all float32 or all bfloat16 (`b`). */
void add_rmsnorm(void *x, void *residual, const void *w, void *out, int64_t rows, int64_t n, float eps,
                 int64_t first, int64_t b) {
  for (int64_t r = 0; r < rows; r++) {
    void *res = first ? x : residual;
    const int64_t o = r * n;
    if (!first)
      for (int64_t i = 0; i < n; i++) st(res, (int)b, o + i, ld(res, (int)b, o + i) + ld(x, (int)b, o + i));
    float part[16] = {0};
    for (int64_t i = 0; i < n; i++) {
      const float v = ld(res, (int)b, o + i);
      part[i & 15] += v * v;
    }
    float ss = 0.0f;
    for (int l = 0; l < 16; l++) ss += part[l];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) {
      const float normed = rnd(ld(res, (int)b, o + i) * inv, (int)b);
      st(out, (int)b, o + i, normed * ld(w, (int)b, i));
    }
  }
}

/* Rotate-half rotary on `heads` heads of `d` at `src` (row stride `lds`), into `dst` (row stride `ldd`):
 * dst = src * cos + rotate_half(src) * sin, each product and the sum rounded in the activation dtype. */
static void rotate(const void *src, int64_t lds, void *dst, int64_t ldd, int64_t rows, int64_t heads, int64_t d,
                   const int64_t *pos, const float *cos_t, const float *sin_t, int b, int db) {
  const int64_t half = d / 2;
  for (int64_t r = 0; r < rows; r++) {
    const float *c = cos_t + pos[r] * d, *s = sin_t + pos[r] * d;
    for (int64_t h = 0; h < heads; h++) {
      const int64_t si = r * lds + h * d, di = r * ldd + h * d;
      for (int64_t i = 0; i < d; i++) {
        const float xi = ld(src, b, si + i);
        const float rot = i < half ? -ld(src, b, si + i + half) : ld(src, b, si + i - half);
        const float cc = rnd(c[i], b), ss = rnd(s[i], b);
        st(dst, db, di + i, rnd(rnd(xi * cc, b) + rnd(rot * ss, b), b));
      }
    }
  }
}

/* From a fused q|k|v projection `qkv` [rows, (H + 2 KVH) d] (row stride `ldq`): q rotated into `q_out`
 * [rows, H, d]; k rotated and v copied into the caches [slots, KVH, d] at `slots[r]`. Activations float32 or
 * bfloat16 (`b`); the caches float32 or bfloat16 (`cb`). cos/sin: float32 tables [positions, d]. */
void rope_store(const void *qkv, int64_t ldq, int64_t rows, int64_t H, int64_t KVH, int64_t d, const int64_t *pos,
                const float *cos_t, const float *sin_t, void *q_out, void *k_cache, void *v_cache,
                const int64_t *slots, int64_t b, int64_t cb) {
  const int64_t esz = b ? 2 : 4, kv = KVH * d;
  rotate(qkv, ldq, q_out, H * d, rows, H, d, pos, cos_t, sin_t, (int)b, (int)b);
  for (int64_t r = 0; r < rows; r++) {
    const char *row = (const char *)qkv + r * ldq * esz;
    /* k: rotated in the activation dtype, then stored (rounded to the cache dtype as index_copy_ converts) */
    float kr[1024];
    for (int64_t c0 = 0; c0 < KVH; c0 += 1024 / d) {
      const int64_t nh = KVH - c0 < 1024 / d ? KVH - c0 : 1024 / d;
      rotate(row + (H + c0) * d * esz, 0, kr, 0, 1, nh, d, pos + r, cos_t, sin_t, (int)b, 0);
      for (int64_t i = 0; i < nh * d; i++) st(k_cache, (int)cb, slots[r] * kv + c0 * d + i, kr[i]);
    }
    for (int64_t i = 0; i < kv; i++) st(v_cache, (int)cb, slots[r] * kv + i, ld(row, (int)b, (H + KVH) * d + i));
  }
}

/* gate_up [rows, 2n] (row stride `ld`) -> out [rows, n] = silu(gate) * up, rounded after each as torch. */
void silu_mul(const void *gate_up, int64_t ldg, void *out, int64_t rows, int64_t n, int64_t b) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t i = 0; i < n; i++) {
      const float g = ld(gate_up, (int)b, r * ldg + i), u = ld(gate_up, (int)b, r * ldg + n + i);
      const float s = rnd(g / (1.0f + expf(-g)), (int)b);
      st(out, (int)b, r * n + i, s * u);
    }
}
