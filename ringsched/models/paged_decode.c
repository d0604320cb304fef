/* Decode attention over the paged KV cache, for float32 on CPU.
 *
 * Each decode row attends to its own context, read in place through its block table: no gathered copy of the
 * keys and values and no padding to the longest context in the batch (what the torch path does). Per row it
 * walks the context once for the scores (every query head of a key-value head shares the key read), takes
 * the softmax in a small scratch buffer, and walks it once more for the values. Rows are split over
 * `nthreads` threads. Built by ringsched/models/native.py; compiled with -ffast-math (vectorised expf and
 * dot products) but linked without it, so loading it does not switch the process to flush-to-zero.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_THREADS 64
#define PREFETCH_AHEAD 4 /* positions: blocks are scattered, so the hardware prefetcher loses the stream */

typedef struct {
  const float *q, *kc, *vc; /* q [b, H, D]; caches [slots, KVH, D] */
  const int64_t *tables, *lens; /* [b, nblk] block ids; [b] context lengths (>= 1) */
  int64_t H, KVH, D, bs, nblk, max_len;
  float scale;
  float *out; /* [b, H, D] */
  int64_t r0, r1;
  int ok;
} job_t;

static inline int64_t slot_of(const int64_t *tab, int64_t bs, int64_t t) { return tab[t / bs] * bs + t % bs; }

static inline void prefetch_row(const float *cache, int64_t slot, int64_t width) {
  const char *p = (const char *)(cache + slot * width);
  for (int64_t c = 0; c < width * (int64_t)sizeof(float); c += 64) __builtin_prefetch(p + c);
}

static void attend_row(const job_t *j, int64_t r, float *sc) {
  const int64_t H = j->H, KVH = j->KVH, D = j->D, bs = j->bs, G = H / KVH, len = j->lens[r], w = KVH * D;
  const int64_t *tab = j->tables + r * j->nblk;
  const float *q = j->q + r * H * D;
  float *o = j->out + r * H * D;
  for (int64_t t = 0; t < len; t++) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(j->kc, slot_of(tab, bs, t + PREFETCH_AHEAD), w);
    const float *k = j->kc + slot_of(tab, bs, t) * w;
    for (int64_t h = 0; h < H; h++) {
      const float *kh = k + (h / G) * D, *qh = q + h * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; d++) s += qh[d] * kh[d];
      sc[h * len + t] = s * j->scale;
    }
  }
  for (int64_t h = 0; h < H; h++) {
    float *s = sc + h * len, m = s[0], sum = 0.f; /* no -inf anywhere: fast-math assumes finite values */
    for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; t++) {
      s[t] = expf(s[t] - m);
      sum += s[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < len; t++) s[t] *= inv;
  }
  for (int64_t i = 0; i < H * D; i++) o[i] = 0.f;
  for (int64_t t = 0; t < len; t++) {
    if (t + PREFETCH_AHEAD < len) prefetch_row(j->vc, slot_of(tab, bs, t + PREFETCH_AHEAD), w);
    const float *v = j->vc + slot_of(tab, bs, t) * w;
    for (int64_t h = 0; h < H; h++) {
      const float *vh = v + (h / G) * D, p = sc[h * len + t];
      float *oh = o + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; d++) oh[d] += p * vh[d];
    }
  }
}

static void *run_job(void *arg) {
  job_t *j = (job_t *)arg;
  float *sc = (float *)malloc(sizeof(float) * j->H * j->max_len);
  if (!sc) return NULL;
  for (int64_t r = j->r0; r < j->r1; r++) attend_row(j, r, sc);
  free(sc);
  j->ok = 1;
  return NULL;
}

/* Returns 0 on success, -1 if a worker could not get its scratch memory. */
int paged_decode(const float *q, const float *kc, const float *vc, const int64_t *tables, const int64_t *lens,
                 int64_t b, int64_t H, int64_t KVH, int64_t D, int64_t bs, int64_t nblk, int64_t max_len,
                 float scale, float *out, int64_t nthreads) {
  if (b <= 0) return 0;
  if (nthreads > b) nthreads = b;
  if (nthreads > MAX_THREADS) nthreads = MAX_THREADS;
  if (nthreads < 1) nthreads = 1;
  job_t jobs[MAX_THREADS];
  pthread_t threads[MAX_THREADS];
  int started[MAX_THREADS] = {0};
  const int64_t per = (b + nthreads - 1) / nthreads;
  for (int64_t i = 0; i < nthreads; i++) {
    const int64_t r0 = i * per, r1 = (i + 1) * per < b ? (i + 1) * per : b;
    const job_t j = {q, kc, vc, tables, lens, H, KVH, D, bs, nblk, max_len, scale, out, r0, r1, 0};
    jobs[i] = j;
  }
  for (int64_t i = 1; i < nthreads; i++) started[i] = pthread_create(&threads[i], NULL, run_job, &jobs[i]) == 0;
  run_job(&jobs[0]);
  int ok = jobs[0].ok;
  for (int64_t i = 1; i < nthreads; i++) {
    if (started[i])
      pthread_join(threads[i], NULL);
    else
      run_job(&jobs[i]); /* no thread to be had: do its rows here */
    ok = ok && jobs[i].ok;
  }
  return ok ? 0 : -1;
}
