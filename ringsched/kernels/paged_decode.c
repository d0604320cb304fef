/* Decode attention over the paged KV cache, for float32 or bfloat16 caches on CPU.
 *
 * Each decode row attends to its own context, read in place through its block table: no gathered copy of the
 * keys and values and no padding to the longest context in the batch (what the torch path does). Per row it
 * walks the context once for the scores (every query head of a key-value head shares the key read), takes
 * the softmax in a small scratch buffer, and walks it once more for the values. Rows are split over
 * `nthreads` threads of torch's own OpenMP team (the library links the libgomp torch has loaded, as the linear
 * kernels do: a thread created per call ran beside that team's spinning worker, on 2 cores at half speed).
 * Queries, scores and outputs are float32 in both cases; a bfloat16 cache is widened as it is read (its 16 bits
 * are a float32's top half), so it costs half the memory traffic of a float32 one.
 * Built by ringsched/kernels/native.py; compiled with -ffast-math (vectorised expf and dot products) but
 * linked without it, so loading it does not switch the process to flush-to-zero.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_THREADS 64
#define PREFETCH_AHEAD 4 /* positions: blocks are scattered, so the hardware prefetcher loses the stream */

typedef struct {
  const float *q; /* [b, H, D] */
  const void *kc, *vc; /* [slots, KVH, D], float32 or bfloat16 (kv_bf16) */
  const int64_t *tables, *lens; /* [b, nblk] block ids; [b] context lengths (>= 1) */
  int64_t H, KVH, D, bs, nblk, max_len;
  float scale;
  int64_t window; /* > 0: each row attends to its last `window` positions only (a sliding layer) */
  float softcap;  /* > 0: scores -> softcap * tanh(scores / softcap) */
  float *out; /* [b, H, D] */
  float *lse; /* [b, H] each row's log-sum-exp of its scaled scores, or NULL (context parallelism merges by it) */
  int64_t r0, r1;
  int kv_bf16;
  int ok;
} job_t;

static inline int64_t slot_of(const int64_t *tab, int64_t bs, int64_t t) { return tab[t / bs] * bs + t % bs; }

static inline void prefetch_row(const void *cache, int64_t slot, int64_t bytes) {
  const char *p = (const char *)cache + slot * bytes;
  for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(p + c);
}

static inline float f32_of_f32(float x) { return x; }

static inline float f32_of_bf16(uint16_t x) {
  const uint32_t u = (uint32_t)x << 16;
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/* One row's attention with caches of element type KT, widened to float32 by WIDEN. */
#define DEFINE_ATTEND_ROW(NAME, KT, WIDEN)                                                                     \
  static void NAME(const job_t *j, int64_t r, float *sc) {                                                     \
    const int64_t H = j->H, KVH = j->KVH, D = j->D, bs = j->bs, G = H / KVH, w = KVH * D;                     \
    const int64_t t0 = j->window > 0 && j->lens[r] > j->window ? j->lens[r] - j->window : 0;                  \
    const int64_t len = j->lens[r] - t0, nblk = j->nblk;                                                      \
    const int64_t *tab = j->tables + r * nblk;                                                                 \
    const KT *kc = (const KT *)j->kc, *vc = (const KT *)j->vc;                                                \
    const float *q = j->q + r * H * D;                                                                         \
    float *o = j->out + r * H * D;                                                                             \
    for (int64_t t = 0; t < len; t++) {                                                                        \
      if (t + PREFETCH_AHEAD < len) prefetch_row(kc, slot_of(tab, bs, t0 + t + PREFETCH_AHEAD), w * sizeof(KT)); \
      const KT *k = kc + slot_of(tab, bs, t0 + t) * w;                                                         \
      for (int64_t h = 0; h < H; h++) {                                                                        \
        const KT *kh = k + (h / G) * D;                                                                        \
        const float *qh = q + h * D;                                                                           \
        float s = 0.f;                                                                                         \
        _Pragma("omp simd reduction(+ : s)") for (int64_t d = 0; d < D; d++) s += qh[d] * WIDEN(kh[d]);        \
        s *= j->scale;                                                                                         \
        sc[h * len + t] = j->softcap > 0.f ? j->softcap * tanhf(s / j->softcap) : s;                           \
      }                                                                                                        \
    }                                                                                                          \
    softmax_rows(sc, H, len, j->lse ? j->lse + r * H : NULL);                                                  \
    for (int64_t i = 0; i < H * D; i++) o[i] = 0.f;                                                            \
    for (int64_t t = 0; t < len; t++) {                                                                        \
      if (t + PREFETCH_AHEAD < len) prefetch_row(vc, slot_of(tab, bs, t0 + t + PREFETCH_AHEAD), w * sizeof(KT)); \
      const KT *v = vc + slot_of(tab, bs, t0 + t) * w;                                                         \
      for (int64_t h = 0; h < H; h++) {                                                                        \
        const KT *vh = v + (h / G) * D;                                                                        \
        const float p = sc[h * len + t];                                                                       \
        float *oh = o + h * D;                                                                                 \
        _Pragma("omp simd") for (int64_t d = 0; d < D; d++) oh[d] += p * WIDEN(vh[d]);                         \
      }                                                                                                        \
    }                                                                                                          \
  }

static void softmax_rows(float *sc, int64_t H, int64_t len, float *lse) {
  for (int64_t h = 0; h < H; h++) {
    float *s = sc + h * len, m = s[0], sum = 0.f; /* no -inf anywhere: fast-math assumes finite values */
    for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; t++) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
    if (lse) lse[h] = m + logf(sum);
#pragma omp simd
    for (int64_t t = 0; t < len; t++) s[t] *= inv;
  }
}

DEFINE_ATTEND_ROW(attend_row_f32, float, f32_of_f32)
DEFINE_ATTEND_ROW(attend_row_bf16, uint16_t, f32_of_bf16)

static void run_job(job_t *j) {
  float *sc = (float *)malloc(sizeof(float) * j->H * j->max_len);
  if (!sc) return;
  for (int64_t r = j->r0; r < j->r1; r++) (j->kv_bf16 ? attend_row_bf16 : attend_row_f32)(j, r, sc);
  free(sc);
  j->ok = 1;
}

/* `paged_decode` for a sliding (`window` > 0) or soft-capped (`softcap` > 0) layer. Returns 0 on success, -1 if a
   worker could not get its scratch memory. */
int paged_decode_window(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                        int64_t b, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t nblk, int64_t max_len,
                        float scale, float *out, int64_t nthreads, int64_t kv_bf16, float *lse, int64_t window,
                        float softcap) {
  if (b <= 0) return 0;
  if (nthreads > b) nthreads = b;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads < 1) nthreads = 1;
  job_t jobs[MAX_THREADS];
  const int64_t per = (b + nthreads - 1) / nthreads;
  for (int64_t i = 0; i < nthreads; i++) {
    const int64_t r0 = i * per, r1 = (i + 1) * per < b ? (i + 1) * per : b;
    const job_t j = {q, kc, vc, tables, lens, H, KVH, D, bs, nblk, max_len, scale, window, softcap, out, lse, r0, r1,
                     (int)kv_bf16, 0};
    jobs[i] = j;
  }
#pragma omp parallel for schedule(static, 1) num_threads(nthreads) if (nthreads > 1)
  for (int64_t i = 0; i < nthreads; i++) run_job(&jobs[i]);
  int ok = 1;
  for (int64_t i = 0; i < nthreads; i++) ok = ok && jobs[i].ok;
  return ok ? 0 : -1;
}

/* Returns 0 on success, -1 if a worker could not get its scratch memory. */
int paged_decode(const float *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens,
                 int64_t b, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t nblk, int64_t max_len,
                 float scale, float *out, int64_t nthreads, int64_t kv_bf16, float *lse) {
  return paged_decode_window(q, kc, vc, tables, lens, b, H, KVH, D, bs, nblk, max_len, scale, out, nthreads, kv_bf16,
                             lse, 0, 0.f);
}
