/* Products whose every output is one dot product in one fixed order, whatever the number of
   rows m beside it, the thread count, or the tile it falls in (quant/row_dot.py).

   The order: LANES-wide partial sums (lane l takes inputs k = l mod LANES) added in input
   order, a fused multiply-add each (one rounding: v_fma, fmaf; nothing else is contracted:
   -ffp-contract=off), then the lanes summed pairwise, halves first (16: l + l8; 8:
   ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))); inputs past the last whole LANES are added one
   at a time after that (fmaf). The q8 kernel below multiplies and adds apart. bfloat16 weights
   take 2*LANES inputs a step (one load, widened by a shift and a mask, not a shuffle):
   lane l adds input 2l+1 of the piece, then input 2l: the order of AVX512-BF16's
   vdpbf16ps, which `rowdot_bf16x` runs on bfloat16 rows where the CPU has it (the same bits
   for values that are not subnormal: it takes those as zero). LANES is 16 with AVX-512, 8 with
   AVX2 (one register each), 8 elsewhere (the same arithmetic lane by lane): the bits are
   the same for every m within one build, and a build is per machine. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

enum { F32 = 0, BF16 = 1, F16 = 2 };

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LANES 16
typedef __m512 v8; /* (the lanes' vector, whatever its width) */
static inline v8 v_zero(void) { return _mm512_setzero_ps(); }
static inline v8 v_load(const float *p) { return _mm512_loadu_ps(p); }
static inline v8 v_add(v8 a, v8 b) { return _mm512_add_ps(a, b); }
static inline v8 v_mul(v8 a, v8 b) { return _mm512_mul_ps(a, b); }
static inline v8 v_fma(v8 a, v8 b, v8 c) { return _mm512_fmadd_ps(a, b, c); }
static inline v8 v_set1(float a) { return _mm512_set1_ps(a); }
static inline v8 v_bf16(const uint16_t *p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
static inline void v_bf16_pair(const uint16_t *p, v8 *even, v8 *odd) {
  __m512i raw = _mm512_loadu_si512((const void *)p);
  *even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  *odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32((int)0xFFFF0000u)));
}
static inline v8 v_f16(const uint16_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
static inline v8 v_i8(const int8_t *p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
static inline float v_sum(v8 v) { /* lane l + l8, then as the 8 lanes below */
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LANES 8
typedef __m256 v8;
static inline v8 v_zero(void) { return _mm256_setzero_ps(); }
static inline v8 v_load(const float *p) { return _mm256_loadu_ps(p); }
static inline v8 v_add(v8 a, v8 b) { return _mm256_add_ps(a, b); }
static inline v8 v_mul(v8 a, v8 b) { return _mm256_mul_ps(a, b); }
static inline v8 v_fma(v8 a, v8 b, v8 c) { return _mm256_fmadd_ps(a, b, c); }
static inline v8 v_set1(float a) { return _mm256_set1_ps(a); }
static inline v8 v_bf16(const uint16_t *p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline void v_bf16_pair(const uint16_t *p, v8 *even, v8 *odd) {
  __m256i raw = _mm256_loadu_si256((const __m256i *)p);
  *even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  *odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32((int)0xFFFF0000u)));
}
static inline v8 v_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
static inline v8 v_i8(const int8_t *p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
static inline float v_sum(v8 v) {
  __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* l+l4 */
  __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half)); /* (l0+l4)+(l2+l6), ... */
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#else
#define LANES 8
typedef struct { float l[8]; } v8;
static inline v8 v_zero(void) { v8 r = {{0}}; return r; }
static inline v8 v_load(const float *p) { v8 r; memcpy(r.l, p, 32); return r; }
static inline v8 v_add(v8 a, v8 b) { for (int i = 0; i < 8; i++) a.l[i] = a.l[i] + b.l[i]; return a; }
static inline v8 v_mul(v8 a, v8 b) { for (int i = 0; i < 8; i++) a.l[i] = a.l[i] * b.l[i]; return a; }
static inline v8 v_fma(v8 a, v8 b, v8 c) { for (int i = 0; i < 8; i++) c.l[i] = fmaf(a.l[i], b.l[i], c.l[i]); return c; }
static inline v8 v_set1(float a) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = a; return r; }
static inline v8 v_bf16(const uint16_t *p) {
  v8 r;
  for (int i = 0; i < 8; i++) { uint32_t w = (uint32_t)p[i] << 16; memcpy(&r.l[i], &w, 4); }
  return r;
}
static inline void v_bf16_pair(const uint16_t *p, v8 *even, v8 *odd) {
  for (int i = 0; i < 8; i++) {
    uint32_t e = (uint32_t)p[2 * i] << 16, o = (uint32_t)p[2 * i + 1] << 16;
    memcpy(&even->l[i], &e, 4); memcpy(&odd->l[i], &o, 4);
  }
}
static inline v8 v_f16(const uint16_t *p) {
  v8 r; _Float16 h[8]; memcpy(h, p, 16);
  for (int i = 0; i < 8; i++) r.l[i] = (float)h[i];
  return r;
}
static inline v8 v_i8(const int8_t *p) { v8 r; for (int i = 0; i < 8; i++) r.l[i] = (float)p[i]; return r; }
static inline float v_sum(v8 v) {
  float a = (v.l[0] + v.l[4]) + (v.l[2] + v.l[6]), b = (v.l[1] + v.l[5]) + (v.l[3] + v.l[7]);
  return a + b;
}
#endif

static inline __attribute__((always_inline)) v8 load_w(const char *w, int64_t k, int type) {
  if (type == F32) return v_load((const float *)w + k);
  if (type == BF16) return v_bf16((const uint16_t *)w + k);
  return v_f16((const uint16_t *)w + k);
}

static inline float load_w1(const char *w, int64_t k, int type) {
  if (type == F32) return ((const float *)w)[k];
  uint16_t bits = ((const uint16_t *)w)[k];
  if (type == BF16) { uint32_t wide = (uint32_t)bits << 16; float out; memcpy(&out, &wide, 4); return out; }
  _Float16 h; memcpy(&h, &bits, 2); return (float)h;
}

/* x with each whole 2*LANES piece's even inputs first, then its odd ones (NULL: no memory). */
static float *pair_rows(const float *x, int64_t M, int64_t K) {
  float *xp = (float *)malloc(sizeof(float) * (M * K + 1));
  if (!xp) return NULL;
  const int64_t whole = K - K % (2 * LANES);
  for (int64_t m = 0; m < M; m++) {
    const float *r = x + m * K; float *o = xp + m * K;
    for (int64_t k = 0; k < whole; k += 2 * LANES)
      for (int l = 0; l < LANES; l++) { o[k + l] = r[k + 2 * l]; o[k + LANES + l] = r[k + 2 * l + 1]; }
    for (int64_t k = whole; k < K; k++) o[k] = r[k];
  }
  return xp;
}

/* Outputs (row m0 + j, column n0 + i) for i < NR, j < MR. */
static inline __attribute__((always_inline)) void tile(
    const float *x, const float *xp, const char *w, int64_t wrow, int64_t N, int64_t K, float *y,
    int64_t n0, int64_t m0, const int NR, const int MR, const int type) {
  v8 acc[4][4];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = v_zero();
  const int64_t step = type == BF16 ? 2 * LANES : LANES, whole = K - K % step;
  if (type == BF16) {
    for (int64_t k = 0; k < whole; k += step) {
      v8 xe[4], xo[4], we[4], wo[4];
      for (int j = 0; j < MR; j++) {
        xe[j] = v_load(xp + (m0 + j) * K + k);
        xo[j] = v_load(xp + (m0 + j) * K + k + LANES);
      }
      for (int i = 0; i < NR; i++)
        v_bf16_pair((const uint16_t *)(w + (n0 + i) * wrow) + k, &we[i], &wo[i]);
      for (int i = 0; i < NR; i++)
        for (int j = 0; j < MR; j++) {
          acc[i][j] = v_fma(xo[j], wo[i], acc[i][j]);
          acc[i][j] = v_fma(xe[j], we[i], acc[i][j]);
        }
    }
  } else {
    for (int64_t k = 0; k < whole; k += LANES) {
      v8 xs[4], ws[4];
      for (int j = 0; j < MR; j++) xs[j] = v_load(x + (m0 + j) * K + k);
      for (int i = 0; i < NR; i++) ws[i] = load_w(w + (n0 + i) * wrow, k, type);
      for (int i = 0; i < NR; i++)
        for (int j = 0; j < MR; j++) acc[i][j] = v_fma(xs[j], ws[i], acc[i][j]);
    }
  }
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) {
      float sum = v_sum(acc[i][j]);
      for (int64_t k = whole; k < K; k++)
        sum = fmaf(x[(m0 + j) * K + k], load_w1(w + (n0 + i) * wrow, k, type), sum);
      y[(m0 + j) * N + n0 + i] = sum;
    }
}

#define ROWS(NR, type)                                                                \
  do {                                                                                \
    int64_t m0 = mb;                                                                  \
    for (; m0 + 4 <= me; m0 += 4) tile(x, xp, w, wrow, N, K, y, n0, m0, NR, 4, type); \
    switch (me - m0) {                                                                \
      case 3: tile(x, xp, w, wrow, N, K, y, n0, m0, NR, 3, type); break;              \
      case 2: tile(x, xp, w, wrow, N, K, y, n0, m0, NR, 2, type); break;              \
      case 1: tile(x, xp, w, wrow, N, K, y, n0, m0, NR, 1, type); break;              \
    }                                                                                 \
  } while (0)

/* y [M, N] = x [M, K] times weight [N, K] (rows ldw values apart), float32 sums; 4 weight
   rows at a time at every m (four streams from memory, four independent sums), the rows
   ROW_BLOCK at a time (a prompt's many rows: each block stays in the cache while the weight
   passes). 0, or -1 where no memory was left for x's pairs. */
#define ROW_BLOCK 64
#define KERNEL(name, type)                                                            \
  int name(const float *x, int64_t M, const void *weight, int64_t N, int64_t K,       \
           int64_t ldw, float *y, int threads) {                                      \
    const char *w = (const char *)weight;                                             \
    float *pairs = type == BF16 ? pair_rows(x, M, K) : NULL;                          \
    if (type == BF16 && !pairs) return -1;                                            \
    const float *xp = pairs ? pairs : x;                                              \
    const int64_t wrow = ldw * (type == F32 ? 4 : 2), tiles = (N + 3) / 4;            \
    for (int64_t mb = 0; mb < M; mb += ROW_BLOCK) {                                   \
      const int64_t me = mb + ROW_BLOCK < M ? mb + ROW_BLOCK : M;                     \
      _Pragma("omp parallel for schedule(static) num_threads(threads)")               \
      for (int64_t t = 0; t < tiles; t++) {                                           \
        const int64_t n0 = t * 4;                                                     \
        switch (N - n0 >= 4 ? 4 : N - n0) {                                           \
          case 4: ROWS(4, type); break;                                               \
          case 3: ROWS(3, type); break;                                               \
          case 2: ROWS(2, type); break;                                               \
          default: ROWS(1, type); break;                                              \
        }                                                                             \
      }                                                                               \
    }                                                                                 \
    free(pairs);                                                                      \
    return 0;                                                                         \
  }

int rowdot_lanes(void) { return LANES; }

#if LANES == 16 && defined(__AVX512BF16__)
/* Outputs (row m0 + j, column n0 + i) of bfloat16 rows x: vdpbf16ps adds, in each lane, the
   pair's odd product, then its even one (each exact in float32, rounded once when added:
   as `tile`'s two fmas, subnormal inputs and sums taken as zero); the tail as `tile`'s. */
static inline __attribute__((always_inline)) void tile_dot(
    const uint16_t *x, const char *w, int64_t wrow, int64_t N, int64_t K, float *y,
    int64_t n0, int64_t m0, const int NR, const int MR) {
  __m512 acc[4][4];
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) acc[i][j] = _mm512_setzero_ps();
  const int64_t whole = K - K % 32;
  for (int64_t k = 0; k < whole; k += 32) {
    __m512bh xs[4], ws[4];
    for (int j = 0; j < MR; j++) xs[j] = (__m512bh)_mm512_loadu_si512(x + (m0 + j) * K + k);
    for (int i = 0; i < NR; i++)
      ws[i] = (__m512bh)_mm512_loadu_si512((const uint16_t *)(w + (n0 + i) * wrow) + k);
    for (int i = 0; i < NR; i++)
      for (int j = 0; j < MR; j++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xs[j], ws[i]);
  }
  for (int i = 0; i < NR; i++)
    for (int j = 0; j < MR; j++) {
      float sum = v_sum(acc[i][j]);
      for (int64_t k = whole; k < K; k++)
        sum = fmaf(load_w1((const char *)(x + (m0 + j) * K), k, BF16),
                   load_w1(w + (n0 + i) * wrow, k, BF16), sum);
      y[(m0 + j) * N + n0 + i] = sum;
    }
}

#define DOT_ROWS(NR)                                                              \
  do {                                                                            \
    int64_t m0 = mb;                                                              \
    for (; m0 + 4 <= me; m0 += 4) tile_dot(x, w, wrow, N, K, y, n0, m0, NR, 4);   \
    switch (me - m0) {                                                            \
      case 3: tile_dot(x, w, wrow, N, K, y, n0, m0, NR, 3); break;                \
      case 2: tile_dot(x, w, wrow, N, K, y, n0, m0, NR, 2); break;                \
      case 1: tile_dot(x, w, wrow, N, K, y, n0, m0, NR, 1); break;                \
    }                                                                             \
  } while (0)

/* y [M, N] = bfloat16 x [M, K] times bfloat16 weight [N, K]: `rowdot_bf16`'s tiles and
   blocks, its bits (subnormals aside), the products two at a time. */
int rowdot_bf16x(const uint16_t *x, int64_t M, const void *weight, int64_t N, int64_t K,
                 int64_t ldw, float *y, int threads) {
  const char *w = (const char *)weight;
  const int64_t wrow = ldw * 2, tiles = (N + 3) / 4;
  for (int64_t mb = 0; mb < M; mb += ROW_BLOCK) {
    const int64_t me = mb + ROW_BLOCK < M ? mb + ROW_BLOCK : M;
    _Pragma("omp parallel for schedule(static) num_threads(threads)")
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * 4;
      switch (N - n0 >= 4 ? 4 : N - n0) {
        case 4: DOT_ROWS(4); break;
        case 3: DOT_ROWS(3); break;
        case 2: DOT_ROWS(2); break;
        default: DOT_ROWS(1); break;
      }
    }
  }
  return 0;
}
int rowdot_bf16_dot(void) { return 1; }
#else
int rowdot_bf16x(const uint16_t *x, int64_t M, const void *weight, int64_t N, int64_t K,
                 int64_t ldw, float *y, int threads) {
  (void)x; (void)M; (void)weight; (void)N; (void)K; (void)ldw; (void)y; (void)threads;
  return -2; /* (not built here: row_dot.py asks rowdot_bf16_dot first) */
}
int rowdot_bf16_dot(void) { return 0; }
#endif

KERNEL(rowdot_f32, F32)
KERNEL(rowdot_bf16, BF16)
KERNEL(rowdot_f16, F16)

/* q8 weights by block column (quant/layouts.py): q int8 [blocks, N, g], g a multiple of 8
   up to Q8_MAX_GROUP,
   scales and offsets [blocks, N] (float16 where `half`, else float32; offsets may be
   NULL). Each output: over the blocks in turn, the block's 8-wide products summed over
   its 8-value pieces in turn, times the block's scale (plus, with offsets, the pieces of x
   summed, times the offset), added to the output's 8-wide sum; then the lanes as above. */
static inline float scalar_of(const void *values, int64_t i, int half) {
  if (!half) return ((const float *)values)[i];
  _Float16 h; memcpy(&h, (const uint16_t *)values + i, 2); return (float)h;
}

#define Q8_SUMS 1024 /* 8-wide sums a thread keeps at once (32 KiB: in L1/L2) */
#define Q8_MAX_GROUP 256 /* values in a block, at most (row_dot.py checks) */

/* The products of the outputs n0..n1 - 1 of rows 0..M - 1, block by block (G values a block:
   a constant where inlined with one, so that the block's widened weights stay in registers);
   `sums` [m][b]: each row's block of x summed (8-wide, over the block's pieces in turn),
   for the offsets. */
static inline __attribute__((always_inline)) void q8_outputs(
    const float *x, int64_t M, const int8_t *q, const void *scales, const void *offsets,
    const v8 *sums, int half, int64_t N, int64_t blocks, const int64_t G, int64_t n0,
    int64_t n1, v8 *acc) {
  const int64_t K = blocks * G;
  for (int64_t b = 0; b < blocks; b++)
    for (int64_t n = n0; n < n1; n++) {
      const int8_t *qs = q + (b * N + n) * G;
      v8 qv[Q8_MAX_GROUP / LANES]; /* the block's weights widened once for every row */
      for (int64_t k = 0; k < G; k += LANES) qv[k / LANES] = v_i8(qs + k);
      const v8 scale = v_set1(scalar_of(scales, b * N + n, half));
      const v8 offset = offsets ? v_set1(scalar_of(offsets, b * N + n, half)) : v_zero();
      v8 *a = acc + (n - n0) * M;
      for (int64_t m = 0; m < M; m++) {
        const float *xs = x + m * K + b * G;
        v8 part = v_zero();
        for (int64_t k = 0; k < G; k += LANES) part = v_add(part, v_mul(v_load(xs + k), qv[k / LANES]));
        a[m] = v_add(a[m], v_mul(part, scale));
        if (offsets) a[m] = v_add(a[m], v_mul(sums[m * blocks + b], offset));
      }
    }
}

int rowdot_q8(const float *x, int64_t M, const int8_t *q, const void *scales,
              const void *offsets, int half, int64_t N, int64_t blocks, int64_t g,
              float *y, int threads) {
  /* Outputs a thread takes at once: many where the rows are few, so that each block
     column is read in long runs (the order of each output's sums is the same). */
  const int64_t chunk = M >= 64 ? 16 : Q8_SUMS / M;
  const int64_t K = blocks * g, chunks = (N + chunk - 1) / chunk;
  v8 *sums = NULL;
  if (offsets) { /* (once a call: they do not depend on the output) */
    sums = (v8 *)aligned_alloc(64, ((M * blocks * sizeof(v8) + 63) / 64) * 64 + 64);
    if (!sums) return -1;
    for (int64_t m = 0; m < M; m++)
      for (int64_t b = 0; b < blocks; b++) {
        v8 whole = v_zero();
        for (int64_t k = 0; k < g; k += LANES) whole = v_add(whole, v_load(x + m * K + b * g + k));
        sums[m * blocks + b] = whole;
      }
  }
  _Pragma("omp parallel num_threads(threads)") {
    v8 acc[Q8_SUMS]; /* [n - n0][m] */
    _Pragma("omp for schedule(static)")
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t n0 = c * chunk, n1 = n0 + chunk < N ? n0 + chunk : N;
      for (int64_t i = 0; i < (n1 - n0) * M; i++) acc[i] = v_zero();
      if (g == 32)
        q8_outputs(x, M, q, scales, offsets, sums, half, N, blocks, 32, n0, n1, acc);
      else
        q8_outputs(x, M, q, scales, offsets, sums, half, N, blocks, g, n0, n1, acc);
      for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) y[m * N + n] = v_sum(acc[(n - n0) * M + m]);
    }
  }
  free(sums);
  return 0;
}
