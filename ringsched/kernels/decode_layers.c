/* A stage's decoder layers for a decode step of a few rows, as one call: the same native kernels, in the same
 * order, on the same buffers as `DecoderLayer._small_step` runs them from Python one call at a time.
 *
 * At one request a layer is nine native calls (two RMSNorms, four linear layers, rotary with the KV writes,
 * decode attention, SiLU x up) whose arithmetic takes ~0.8 ms on two cores; the Python around them (module
 * calls, tensor allocations, ctypes argument conversion) took another ~0.1 ms a layer. Here the kernels are
 * reached through function pointers taken from their own libraries, so each keeps the compile flags its results
 * depend on (layer_ops.c is built without FMA contraction to match torch bit for bit); this file only sequences
 * them. Built by ringsched/kernels/decode_layers.py.
 */
#include <stdint.h>
#include <string.h>

typedef int (*linear_kn_t)(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const float *w,
                           int64_t ldw, int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads);
typedef int (*linear_nk_t)(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const void *w,
                           int64_t wtype, const float *scales, int64_t N, const float *bias, void *y, int64_t y_bf16,
                           int64_t nthreads);
typedef void (*add_rmsnorm_t)(void *x, void *residual, const void *w, void *out, int64_t rows, int64_t n, float eps,
                              int64_t first, int64_t b);
typedef void (*rope_store_t)(const void *qkv, int64_t ldq, int64_t rows, int64_t H, int64_t KVH, int64_t d,
                             const int64_t *pos, const float *cos_t, const float *sin_t, void *q_out, void *k_cache,
                             void *v_cache, const int64_t *slots, int64_t b, int64_t cb);
typedef void (*silu_mul_t)(const void *gate_up, int64_t ldg, void *out, int64_t rows, int64_t n, int64_t b);
typedef int (*paged_decode_t)(const float *q, const void *kc, const void *vc, const int64_t *tables,
                              const int64_t *lens, int64_t b, int64_t H, int64_t KVH, int64_t D, int64_t bs,
                              int64_t nblk, int64_t max_len, float scale, float *out, int64_t nthreads,
                              int64_t kv_bf16, float *lse);

typedef int (*gguf_linear_t)(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const void *w,
                             int64_t type, int64_t N, const float *bias, void *y, int64_t y_bf16, int64_t nthreads);

typedef int (*gguf_parts_t)(const void *x, int64_t ldx, int64_t x_bf16, int64_t M, int64_t K, const int64_t *parts,
                            int64_t nparts, const float *bias, void *y, int64_t y_bf16, int64_t nthreads);

/* The kernels, in this order in `fns`. */
enum { F_LINEAR_KN, F_LINEAR_NK, F_ADD_RMSNORM, F_ROPE_STORE, F_SILU_MUL, F_PAGED_DECODE, F_GGUF_LINEAR, F_GGUF_PARTS,
       F_COUNT };

/* One linear layer: 7 words. form 0: float32 weights laid out [K, N] (linear_kn), 1: [N, K] (linear_nk), 2: a GGUF
 * type's blocks (gguf_linear; the type in L_WTYPE), 3: parts of GGUF types side by side (gguf_linear_parts; L_W
 * the parts' descriptor, L_WTYPE their count). */
enum { L_FORM, L_W, L_WTYPE, L_SCALES, L_BIAS, L_N, L_K, L_WORDS };
/* One layer: its norms' weights, its caches, then its four linear layers. */
enum { Y_IN_NORM, Y_POST_NORM, Y_K_CACHE, Y_V_CACHE, Y_QKV, Y_O = Y_QKV + L_WORDS, Y_GATE_UP = Y_O + L_WORDS,
       Y_DOWN = Y_GATE_UP + L_WORDS, Y_WORDS = Y_DOWN + L_WORDS };

static int linear(void *const *fns, const int64_t *l, const void *x, int64_t rows, void *y, int64_t b,
                  int64_t nthreads) {
  const int64_t n = l[L_N], k = l[L_K];
  if (l[L_FORM] == 0)
    return ((linear_kn_t)fns[F_LINEAR_KN])(x, k, b, rows, k, (const float *)l[L_W], n, n, (const float *)l[L_BIAS],
                                           y, b, nthreads);
  if (l[L_FORM] == 3)
    return ((gguf_parts_t)fns[F_GGUF_PARTS])(x, k, b, rows, k, (const int64_t *)l[L_W], l[L_WTYPE],
                                             (const float *)l[L_BIAS], y, b, nthreads);
  if (l[L_FORM] == 2)
    return ((gguf_linear_t)fns[F_GGUF_LINEAR])(x, k, b, rows, k, (const void *)l[L_W], l[L_WTYPE], n,
                                               (const float *)l[L_BIAS], y, b, nthreads);
  return ((linear_nk_t)fns[F_LINEAR_NK])(x, k, b, rows, k, (const void *)l[L_W], l[L_WTYPE],
                                         (const float *)l[L_SCALES], n, (const float *)l[L_BIAS], y, b, nthreads);
}

static inline uint16_t to_bf(float f) { /* round to nearest even, as torch */
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* Layers `layers[0..count)` (rows of `desc`, Y_WORDS each; `eps` two per layer) over `rows` decode rows.
 * `dims`: hidden, heads, kv heads, head dim, intermediate, block size, table width, longest context.
 * `step`: positions, slots, block tables, context lengths, cos table, sin table.
 * `bufs`: hidden (the input, normed in place as `RMSNorm.add_forward` does; it becomes the residual when
 * bufs[1] is 0, the stage's first layer on stage 0), the residual, then scratch: qkv, q, q as float32, attention
 * out (float32), attention out in the model's dtype, o, gate_up, act, and two buffers the layers' outputs take in
 * turn. On return bufs[0] and bufs[1] point at the last output and the residual.
 * Returns 0, or the first nonzero a kernel returned. */
int decode_layers(void *const *fns, const int64_t *desc, const float *eps, const int64_t *layers, int64_t count,
                  int64_t rows, const int64_t *dims, const int64_t *step, void **bufs, float scale, int64_t b,
                  int64_t kv_b, int64_t nthreads) {
  const int64_t hidden = dims[0], H = dims[1], KVH = dims[2], hd = dims[3], inter = dims[4];
  const int64_t nqkv = (H + 2 * KVH) * hd, nq = H * hd;
  const int64_t *pos = (const int64_t *)step[0], *slots = (const int64_t *)step[1];
  const int64_t *tables = (const int64_t *)step[2], *lens = (const int64_t *)step[3];
  const float *cos_t = (const float *)step[4], *sin_t = (const float *)step[5];
  void *x = bufs[0], *res = bufs[1];
  void *qkv = bufs[2], *q = bufs[3], *att_x = bufs[6], *o = bufs[7], *gate_up = bufs[8], *act = bufs[9];
  float *qf = (float *)bufs[4], *att = (float *)bufs[5];
  void *out = bufs[10];
  int rc;
  for (int64_t i = 0; i < count; i++) {
    const int64_t *y = desc + layers[i] * Y_WORDS;
    const float *e = eps + 2 * layers[i];
    void *h;
    if (res == 0) { /* the stage's first layer of stage 0: the input becomes the residual */
      ((add_rmsnorm_t)fns[F_ADD_RMSNORM])(x, x, (const void *)y[Y_IN_NORM], out, rows, hidden, e[0], 1, b);
      res = x;
      h = out;
    } else {
      ((add_rmsnorm_t)fns[F_ADD_RMSNORM])(x, res, (const void *)y[Y_IN_NORM], x, rows, hidden, e[0], 0, b);
      h = x;
    }
    if ((rc = linear(fns, y + Y_QKV, h, rows, qkv, b, nthreads))) return rc;
    ((rope_store_t)fns[F_ROPE_STORE])(qkv, nqkv, rows, H, KVH, hd, pos, cos_t, sin_t, q, (void *)y[Y_K_CACHE],
                                      (void *)y[Y_V_CACHE], slots, b, kv_b);
    const float *qin = (const float *)q;
    if (b) {
      for (int64_t j = 0; j < rows * nq; j++) qf[j] = from_bf(((const uint16_t *)q)[j]);
      qin = qf;
    }
    if ((rc = ((paged_decode_t)fns[F_PAGED_DECODE])(qin, (const void *)y[Y_K_CACHE], (const void *)y[Y_V_CACHE],
                                                   tables, lens, rows, H, KVH, hd, dims[5], dims[6], dims[7], scale,
                                                   att, nthreads, kv_b, 0)))
      return rc;
    const void *a = att;
    if (b) {
      for (int64_t j = 0; j < rows * nq; j++) ((uint16_t *)att_x)[j] = to_bf(att[j]);
      a = att_x;
    }
    if ((rc = linear(fns, y + Y_O, a, rows, o, b, nthreads))) return rc;
    ((add_rmsnorm_t)fns[F_ADD_RMSNORM])(o, res, (const void *)y[Y_POST_NORM], o, rows, hidden, e[1], 0, b);
    if ((rc = linear(fns, y + Y_GATE_UP, o, rows, gate_up, b, nthreads))) return rc;
    ((silu_mul_t)fns[F_SILU_MUL])(gate_up, 2 * inter, act, rows, inter, b);
    if ((rc = linear(fns, y + Y_DOWN, act, rows, out, b, nthreads))) return rc;
    /* the output is the next layer's input (its norm goes back into it); the next output takes the other buffer */
    x = out;
    out = out == bufs[10] ? bufs[11] : bufs[10];
  }
  bufs[0] = x;
  bufs[1] = res;
  return 0;
}
