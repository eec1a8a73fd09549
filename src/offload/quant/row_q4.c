/* 4-bit weights (GGUF's Q4_0, Q4_1 and Q4_K as `w = d * q + m`, q in 0..15, one d and m a
   group of 32 inputs) times float32 rows, with integer products (quant/layouts.py, `q4`).
   Compiled after row_dot.c, in the same library.

   Each row's inputs are first rounded per group of 32 to 15-bit integers: a = max |x|,
   dx = a / 16383, q_x = rint(x * (16383 / a)) (to nearest even), and s = dx * sum q_x. An
   output is then, over its groups in turn: t = (float) (sum q_w q_x) * dx; acc = fma(d, t,
   acc); acc = fma(m, s, acc). The integer sums are exact (each under 2^24), so each output
   is the same arithmetic whatever the number of rows beside it, the thread count, and the
   build: AVX-512 VNNI where the CPU has it (16 outputs a vector, q_x split into a signed
   high byte and a low 7 bits for `vpdpbusd`, unsigned weights times signed inputs), else
   the same sums one output at a time. 15 bits keep a group's largest input to 1/32766
   (bfloat16, torch's int4 kernel's input, keeps 1/512 of each).

   Weights `nib` [ceil(N / 16), K / 32, 4, 64] bytes: for 16 outputs n and one group, piece
   p holds, at byte 4 * n + i, q[n, 8p + i] in its low half and q[n, 8p + 4 + i] in its
   high half (i < 4), so that a piece's halves are two vectors of 16 outputs x 4 inputs.
   Outputs past N are zero. Scales and offsets [K / 32, N] (float16 where `half`).
   `rowdot_q8i`, below, multiplies q8 block columns on the same integers. */

/* One group of 32 inputs `v` -> its high and low bytes; returns dx, sets *sum to sum q_x. */
static inline float q4_group(const float *v, int8_t *high, int8_t *low, int32_t *sum) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float a = _mm512_reduce_max_ps(
      _mm512_max_ps(_mm512_and_ps(v0, magnitude), _mm512_and_ps(v1, magnitude)));
#else
  float a = 0.f;
  for (int i = 0; i < 32; i++) a = fabsf(v[i]) > a ? fabsf(v[i]) : a;
#endif
  const float d = a / 16383.f, inverse = a != 0.f ? 16383.f / a : 0.f;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i seven = _mm512_set1_epi32(127);  /* (cvtps rounds to nearest even, as lrintf) */
  const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inverse)));
  const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inverse)));
  _mm_storeu_si128((__m128i *)high, _mm512_cvtepi32_epi8(_mm512_srai_epi32(q0, 7)));
  _mm_storeu_si128((__m128i *)(high + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q1, 7)));
  _mm_storeu_si128((__m128i *)low, _mm512_cvtepi32_epi8(_mm512_and_si512(q0, seven)));
  _mm_storeu_si128((__m128i *)(low + 16), _mm512_cvtepi32_epi8(_mm512_and_si512(q1, seven)));
  *sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
  *sum = 0;
  for (int i = 0; i < 32; i++) {
    const int32_t q = (int32_t)lrintf(v[i] * inverse);
    high[i] = (int8_t)(q >> 7); /* (floor: -128..127) */
    low[i] = (int8_t)(q & 127);
    *sum += q;
  }
#endif
  return d;
}

static void q4_rows_in(const float *x, int64_t M, int64_t K, int8_t *high, int8_t *low,
                       float *dx, float *sx, int32_t *isum, int threads) {
  const int64_t groups = K / 32;
  _Pragma("omp parallel for schedule(static) num_threads(threads) if(M * K >= 16384)")
  for (int64_t m = 0; m < M; m++)
    for (int64_t g = 0; g < groups; g++) {
      int32_t sum;
      const float d = q4_group(x + m * K + g * 32, high + m * K + g * 32, low + m * K + g * 32, &sum);
      dx[m * groups + g] = d;
      sx[m * groups + g] = d * (float)sum;
      if (isum) isum[m * groups + g] = sum;
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define Q4_VNNI 1
static inline __m512 q4_scales(const void *values, int64_t at, __mmask16 mask, int half) {
  if (half)
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const uint16_t *)values + at));
  return _mm512_maskz_loadu_ps(mask, (const float *)values + at);
}

/* Outputs 16 t .. 16 t + 15 of rows m0 .. m0 + R - 1. */
static inline __attribute__((always_inline)) void q4_tile(
    const uint8_t *nib, const void *scales, const void *offsets, int half, int64_t N,
    int64_t K, const int8_t *high, const int8_t *low, const float *dx, const float *sx,
    int64_t t, int64_t m0, const int R, float *y) {
  const int64_t groups = K / 32, left = N - t * 16;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512 acc[4];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  const uint8_t *tile = nib + t * groups * 256;
  for (int64_t g = 0; g < groups; g++) {
    __m512i w[8];
    for (int p = 0; p < 4; p++) {
      const __m512i piece = _mm512_loadu_si512((const void *)(tile + g * 256 + p * 64));
      w[2 * p] = _mm512_and_si512(piece, nibble);
      w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(piece, 4), nibble);
    }
    const __m512 d = q4_scales(scales, g * N + t * 16, mask, half);
    const __m512 m = q4_scales(offsets, g * N + t * 16, mask, half);
    for (int r = 0; r < R; r++) {
      const int64_t at = (m0 + r) * K + g * 32;
      const int32_t *hi = (const int32_t *)(high + at), *lo = (const int32_t *)(low + at);
      __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) { /* (piece j / 2's half j % 2: inputs 4 j .. 4 j + 3) */
        sum_hi = _mm512_dpbusd_epi32(sum_hi, w[j], _mm512_set1_epi32(hi[j]));
        sum_lo = _mm512_dpbusd_epi32(sum_lo, w[j], _mm512_set1_epi32(lo[j]));
      }
      const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(sum_hi, 7), sum_lo);
      const int64_t row_group = (m0 + r) * groups + g;
      const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[row_group]));
      acc[r] = _mm512_fmadd_ps(d, part, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[row_group]), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (m0 + r) * N + t * 16, mask, acc[r]);
}
#else
#define Q4_VNNI 0
#endif

/* The same sums, one output at a time (where the CPU has no VNNI). */
static void q4_output(const uint8_t *nib, const void *scales, const void *offsets, int half,
                      int64_t N, int64_t K, const int8_t *high, const int8_t *low,
                      const float *dx, const float *sx, int64_t n, int64_t M, float *y) {
  const int64_t groups = K / 32, lane = n % 16;
  const uint8_t *tile = nib + (n / 16) * groups * 256;
  for (int64_t m = 0; m < M; m++) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; g++) {
      int32_t sum = 0;
      for (int k = 0; k < 32; k++) {
        const int piece = k / 8, shift = (k % 8) / 4 * 4, i = k % 4;
        const int32_t q = (tile[g * 256 + piece * 64 + lane * 4 + i] >> shift) & 0x0F;
        const int32_t x = 128 * high[m * K + g * 32 + k] + low[m * K + g * 32 + k];
        sum += q * x;
      }
      const float part = (float)sum * dx[m * groups + g];
      acc = fmaf(scalar_of(scales, g * N + n, half), part, acc);
      acc = fmaf(scalar_of(offsets, g * N + n, half), sx[m * groups + g], acc);
    }
    y[m * N + n] = acc;
  }
}

int rowdot_q4_vnni(void) { return Q4_VNNI; }

/* q8 weights (quant/layouts.py: int8 [K / 32, N, 32] block columns, scales and offsets
   [K / 32, N]) times float32 rows on the same integers: each output, over its blocks in turn,
   t = (float) (sum q_w q_x) * dx; acc = fma(d, t, acc); with offsets acc = fma(m, s, acc).
   For `vpdpbusd` (unsigned times signed) the weights are made unsigned (q_w + 128) and
   128 * sum q_x is taken back off: the integer sum is exact either way, so both paths give
   the same bits. A block column's 16 outputs lie in 512 bytes, output by output; a tile
   transposes them in registers to 8 vectors of 16 outputs x 4 inputs. */
#if Q4_VNNI
#define Q8_AHEAD 4 /* tiles a block column is read ahead */
static inline __attribute__((always_inline)) void q8i_tile(
    const int8_t *q, const void *scales, const void *offsets, int half, int64_t N, int64_t K,
    const int8_t *high, const int8_t *low, const float *dx, const float *sx,
    const int32_t *isum, int64_t t, int64_t m0, const int R, float *y) {
  const int64_t groups = K / 32, left = N - t * 16;
  const __mmask16 mask = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
  /* lane 4 j + i of the first (second) permute: input dword j (4 + j) of output i */
  const __m512i first = _mm512_set_epi32(27, 19, 11, 3, 26, 18, 10, 2, 25, 17, 9, 1, 24, 16, 8, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
  const __m512i flip = _mm512_set1_epi8((char)0x80);
  int8_t tail[512];
  __m512 acc[4];
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    const int8_t *block = q + (g * N + t * 16) * 32;
    if (left > 16 * Q8_AHEAD) /* (18 block columns 1.5 MB apart: the CPU's own streams lag) */
      for (int line = 0; line < 512; line += 64)
        _mm_prefetch((const char *)block + Q8_AHEAD * 512 + line, _MM_HINT_T0);
    if (left < 16) { /* (the last outputs: no bytes past the weight are read) */
      memset(tail, 0, sizeof tail);
      memcpy(tail, block, left * 32);
      block = tail;
    }
    __m512i a[4], b[4], w[8];
    for (int p = 0; p < 4; p++) { /* outputs 4 p .. 4 p + 3 */
      const __m512i lo = _mm512_loadu_si512((const void *)(block + p * 128));
      const __m512i hi = _mm512_loadu_si512((const void *)(block + p * 128 + 64));
      a[p] = _mm512_permutex2var_epi32(lo, first, hi);
      b[p] = _mm512_permutex2var_epi32(lo, second, hi);
    }
    /* 128-bit chunk p of a[j'] holds dword j' of outputs 4 p..: a 4 x 4 transpose of chunks */
    for (int half_ = 0; half_ < 2; half_++) {
      const __m512i *s = half_ ? b : a;
      const __m512i u0 = _mm512_shuffle_i32x4(s[0], s[1], 0x44), u1 = _mm512_shuffle_i32x4(s[0], s[1], 0xEE);
      const __m512i u2 = _mm512_shuffle_i32x4(s[2], s[3], 0x44), u3 = _mm512_shuffle_i32x4(s[2], s[3], 0xEE);
      w[4 * half_ + 0] = _mm512_xor_si512(_mm512_shuffle_i32x4(u0, u2, 0x88), flip);
      w[4 * half_ + 1] = _mm512_xor_si512(_mm512_shuffle_i32x4(u0, u2, 0xDD), flip);
      w[4 * half_ + 2] = _mm512_xor_si512(_mm512_shuffle_i32x4(u1, u3, 0x88), flip);
      w[4 * half_ + 3] = _mm512_xor_si512(_mm512_shuffle_i32x4(u1, u3, 0xDD), flip);
    }
    const __m512 d = q4_scales(scales, g * N + t * 16, mask, half);
    const __m512 m = offsets ? q4_scales(offsets, g * N + t * 16, mask, half) : _mm512_setzero_ps();
    for (int r = 0; r < R; r++) {
      const int64_t at = (m0 + r) * K + g * 32, row_group = (m0 + r) * groups + g;
      const int32_t *hi = (const int32_t *)(high + at), *lo = (const int32_t *)(low + at);
      __m512i sum_hi = _mm512_setzero_si512(), sum_lo = _mm512_setzero_si512();
      for (int j = 0; j < 8; j++) {
        sum_hi = _mm512_dpbusd_epi32(sum_hi, w[j], _mm512_set1_epi32(hi[j]));
        sum_lo = _mm512_dpbusd_epi32(sum_lo, w[j], _mm512_set1_epi32(lo[j]));
      }
      const __m512i sum = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sum_hi, 7), sum_lo),
                                           _mm512_set1_epi32(128 * isum[row_group]));
      const __m512 part = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(dx[row_group]));
      acc[r] = _mm512_fmadd_ps(d, part, acc[r]);
      if (offsets) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx[row_group]), acc[r]);
    }
  }
  for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y + (m0 + r) * N + t * 16, mask, acc[r]);
}
#endif

static void q8i_output(const int8_t *q, const void *scales, const void *offsets, int half,
                       int64_t N, int64_t K, const int8_t *high, const int8_t *low,
                       const float *dx, const float *sx, int64_t n, int64_t M, float *y) {
  const int64_t groups = K / 32;
  for (int64_t m = 0; m < M; m++) {
    float acc = 0.f;
    for (int64_t g = 0; g < groups; g++) {
      const int8_t *w = q + (g * N + n) * 32;
      int32_t sum = 0;
      for (int k = 0; k < 32; k++)
        sum += (int32_t)w[k] * (128 * high[m * K + g * 32 + k] + low[m * K + g * 32 + k]);
      const float part = (float)sum * dx[m * groups + g];
      acc = fmaf(scalar_of(scales, g * N + n, half), part, acc);
      if (offsets) acc = fmaf(scalar_of(offsets, g * N + n, half), sx[m * groups + g], acc);
    }
    y[m * N + n] = acc;
  }
}

enum { Q4 = 0, Q8 = 1 };

/* One tile of either kind: `w` the q4 nibbles or the q8 values. */
static inline __attribute__((always_inline)) void int_tile(
    int kind, const void *w, const void *scales, const void *offsets, int half, int64_t N,
    int64_t K, const int8_t *high, const int8_t *low, const float *dx, const float *sx,
    const int32_t *isum, int64_t t, int64_t m0, const int R, float *y) {
#if Q4_VNNI
  if (kind == Q4)
    q4_tile(w, scales, offsets, half, N, K, high, low, dx, sx, t, m0, R, y);
  else
    q8i_tile(w, scales, offsets, half, N, K, high, low, dx, sx, isum, t, m0, R, y);
#endif
}

/* y [M, N] = x [M, K] times a weight of `kind` on the integer sums above; `plain`: one
   output at a time on one thread (the same bits: the tests compare both where VNNI is
   built). 0, or -1 where no memory was left for x's integers. */
static int int_product(int kind, const float *x, int64_t M, int64_t K, const void *w,
                       const void *scales, const void *offsets, int half, int64_t N, float *y,
                       int threads, int plain) {
  const int64_t groups = K / 32;
  int8_t *high = malloc(M * K + 1), *low = malloc(M * K + 1);
  float *dx = malloc(sizeof(float) * (M * groups + 1)), *sx = malloc(sizeof(float) * (M * groups + 1));
  int32_t *isum = malloc(sizeof(int32_t) * (M * groups + 1));
  int failed = !high || !low || !dx || !sx || !isum;
  if (!failed) {
    threads = plain ? 1 : threads;
    q4_rows_in(x, M, K, high, low, dx, sx, isum, threads);
#if Q4_VNNI
    if (!plain) {
      const int64_t tiles = (N + 15) / 16;
      _Pragma("omp parallel for schedule(static) num_threads(threads)")
      for (int64_t t = 0; t < tiles; t++) {
        int64_t m0 = 0;
        for (; m0 + 4 <= M; m0 += 4)
          int_tile(kind, w, scales, offsets, half, N, K, high, low, dx, sx, isum, t, m0, 4, y);
        switch (M - m0) {
          case 3: int_tile(kind, w, scales, offsets, half, N, K, high, low, dx, sx, isum, t, m0, 3, y); break;
          case 2: int_tile(kind, w, scales, offsets, half, N, K, high, low, dx, sx, isum, t, m0, 2, y); break;
          case 1: int_tile(kind, w, scales, offsets, half, N, K, high, low, dx, sx, isum, t, m0, 1, y); break;
        }
      }
    } else
#endif
    {
      _Pragma("omp parallel for schedule(static) num_threads(threads)")
      for (int64_t n = 0; n < N; n++) {
        if (kind == Q4)
          q4_output(w, scales, offsets, half, N, K, high, low, dx, sx, n, M, y);
        else
          q8i_output(w, scales, offsets, half, N, K, high, low, dx, sx, n, M, y);
      }
    }
  }
  free(high); free(low); free(dx); free(sx); free(isum);
  return failed ? -1 : 0;
}

int rowdot_q4(const float *x, int64_t M, int64_t K, const uint8_t *nib, const void *scales,
              const void *offsets, int half, int64_t N, float *y, int threads, int plain) {
  return int_product(Q4, x, M, K, nib, scales, offsets, half, N, y, threads, plain);
}

/* q8 block columns of 32 values (`rowdot_q8`'s layout). */
int rowdot_q8i(const float *x, int64_t M, int64_t K, const int8_t *q, const void *scales,
               const void *offsets, int half, int64_t N, float *y, int threads, int plain) {
  return int_product(Q8, x, M, K, q, scales, offsets, half, N, y, threads, plain);
}
