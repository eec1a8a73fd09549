/* Attention whose every output is computed from its own query and the columns it reads
   alone, in one fixed order, whatever the other queries of the call (how many, which
   tokens, which heads), the tile a column falls in or the thread count: a prompt's
   position has the same bits prefilled whole, in chunks, or after a cached prefix
   (engine/prompt_attention.py). Compiled after row_dot.c, in the same library (its vector
   helpers, LANES and load_w).

   For query (h, t), reading columns j in [lo, hi) of KV head h / group:
   - s_j = scale * sum_e q_e k_je, the sum over e in turn, a multiply and an add each (one
     lane per column: the lanes of a tile of columns never meet, so where a tile starts does
     not matter);
   - p_j = exp(s_j - max s) (the polynomial below, the same arithmetic in every lane);
   - l = sum p_j: lane i takes j = lo + i mod LANES, in turn, then the lanes as row_dot.c's
     v_sum does;
   - out_e = (sum_j p_j v_je, over j in turn, multiplies and adds) / l.
   (Fused multiply-adds here, 1.2x as fast at 2000 tokens, turned the default model's
   greedy first token from "The" to "L": its two first tokens lie 0.06-0.11 nat apart as stored,
   within what the last bits of attention move.) */

#if defined(__AVX512F__) && defined(__AVX512BW__)
static inline v8 v_sub(v8 a, v8 b) { return _mm512_sub_ps(a, b); }
static inline v8 v_max(v8 a, v8 b) { return _mm512_max_ps(a, b); }
static inline v8 v_div(v8 a, v8 b) { return _mm512_div_ps(a, b); }
static inline void v_store(float *p, v8 a) { _mm512_storeu_ps(p, a); }
static inline v8 v_round(v8 a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v8 v_pow2(v8 n) { /* 2^n, n whole in [-126, 127] */
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
static inline v8 v_sub(v8 a, v8 b) { return _mm256_sub_ps(a, b); }
static inline v8 v_max(v8 a, v8 b) { return _mm256_max_ps(a, b); }
static inline v8 v_div(v8 a, v8 b) { return _mm256_div_ps(a, b); }
static inline void v_store(float *p, v8 a) { _mm256_storeu_ps(p, a); }
static inline v8 v_round(v8 a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline v8 v_pow2(v8 n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
#else
static inline v8 v_sub(v8 a, v8 b) { for (int i = 0; i < 8; i++) a.l[i] = a.l[i] - b.l[i]; return a; }
static inline v8 v_max(v8 a, v8 b) { for (int i = 0; i < 8; i++) a.l[i] = a.l[i] > b.l[i] ? a.l[i] : b.l[i]; return a; }
static inline v8 v_div(v8 a, v8 b) { for (int i = 0; i < 8; i++) a.l[i] = a.l[i] / b.l[i]; return a; }
static inline void v_store(float *p, v8 a) { memcpy(p, a.l, 32); }
static inline v8 v_round(v8 a) { for (int i = 0; i < 8; i++) a.l[i] = rintf(a.l[i]); return a; }
static inline v8 v_pow2(v8 n) {
  v8 r;
  for (int i = 0; i < 8; i++) { uint32_t e = (uint32_t)((int32_t)n.l[i] + 127) << 23; memcpy(&r.l[i], &e, 4); }
  return r;
}
#endif

/* e^x for x <= 0 (below -87: as -87, ~1.6e-38): x = n ln2 + r, |r| <= ln2 / 2, a degree-7
   polynomial in r (Cephes' expf coefficients) times 2^n; each step one rounding. */
static inline v8 v_exp(v8 x) {
  x = v_max(x, v_set1(-87.0f));
  v8 n = v_round(v_mul(x, v_set1(1.44269504088896341f)));
  v8 r = v_sub(x, v_mul(n, v_set1(0.693359375f)));
  r = v_sub(r, v_mul(n, v_set1(-2.12194440e-4f)));
  v8 p = v_set1(1.9875691500e-4f);
  p = v_add(v_mul(p, r), v_set1(1.3981999507e-3f));
  p = v_add(v_mul(p, r), v_set1(8.3334519073e-3f));
  p = v_add(v_mul(p, r), v_set1(4.1665795894e-2f));
  p = v_add(v_mul(p, r), v_set1(1.6666665459e-1f));
  p = v_add(v_mul(p, r), v_set1(5.0000001201e-1f));
  p = v_add(v_add(v_mul(v_mul(p, r), r), r), v_set1(1.0f));
  return v_mul(p, v_pow2(n));
}

#define ATT_TOKENS 16 /* queries' tokens a task takes (each with the group's heads) */
#define ATT_MAX_DIM 256

/* The scores s[0, n) of one query made its softmax's numerators p in place (zeros up to n
   rounded up to LANES); their sum l. */
static float att_softmax(float *s, int64_t n) {
  const int64_t pieces = (n + LANES - 1) / LANES, whole = n - n % LANES;
  v8 top = v_set1(s[0]); /* (a max is the same in any order) */
  for (int64_t j = 0; j < whole; j += LANES) top = v_max(top, v_load(s + j));
  float lanes[LANES], m;
  v_store(lanes, top);
  m = lanes[0];
  for (int l = 1; l < LANES; l++) m = lanes[l] > m ? lanes[l] : m;
  for (int64_t j = whole; j < n; j++) m = s[j] > m ? s[j] : m;
  v8 sum = v_zero();
  const v8 mv = v_set1(m);
  for (int64_t i = 0; i < pieces; i++) {
    v_store(s + i * LANES, v_exp(v_sub(v_load(s + i * LANES), mv)));
    if (i == pieces - 1)
      for (int64_t j = n; j < pieces * LANES; j++) s[j] = 0.0f; /* (adds nothing below) */
    sum = v_add(sum, v_load(s + i * LANES));
  }
  return v_sum(sum);
}

#define ATT_HEADS 4 /* queries of one token (its group's heads) a pass takes together */
#define ATT_QK 12 /* queries a tile of keys is multiplied with at once (independent sums) */

/* acc[c] += q_c[e] * kt[e * stride, + LANES) over e in turn, for c < count (a constant where
   inlined with one: the sums stay in registers). */
static inline __attribute__((always_inline)) void att_dots(
    v8 *acc, const float *const *qs, const float *kt, int64_t stride, int64_t d, const int count) {
  for (int64_t e = 0; e < d; e++) {
    const v8 x = v_load(kt + e * stride);
    for (int c = 0; c < count; c++) acc[c] = v_add(acc[c], v_mul(v_set1(qs[c][e]), x));
  }
}

/* The outputs of `count` queries that read the same n columns: out[i] = sum_j p[i][j] v_j / l[i],
   each over j in turn (the values of v read once for all of them). */
static inline __attribute__((always_inline)) void att_values_(
    float *const *p, const float *l, const int count, int64_t n, const char *v, int64_t vc,
    const int64_t d, int type, float *const *out) {
  v8 acc[ATT_HEADS][ATT_MAX_DIM / LANES];
  float tail[ATT_HEADS][LANES];
  const int64_t whole = d - d % LANES, size = type == F32 ? 4 : 2;
  for (int i = 0; i < count; i++) {
    for (int64_t e = 0; e < whole; e += LANES) acc[i][e / LANES] = v_zero();
    for (int64_t e = whole; e < d; e++) tail[i][e - whole] = 0.0f;
  }
  for (int64_t j = 0; j < n; j++) {
    const char *vj = v + j * vc * size;
    for (int64_t e = 0; e < whole; e += LANES) {
      const v8 x = load_w(vj, e, type);
      for (int i = 0; i < count; i++) acc[i][e / LANES] = v_add(acc[i][e / LANES], v_mul(v_set1(p[i][j]), x));
    }
    for (int64_t e = whole; e < d; e++)
      for (int i = 0; i < count; i++) tail[i][e - whole] = tail[i][e - whole] + p[i][j] * load_w1(vj, e, type);
  }
  for (int i = 0; i < count; i++) {
    const v8 lv = v_set1(l[i]);
    for (int64_t e = 0; e < whole; e += LANES) v_store(out[i] + e, v_div(acc[i][e / LANES], lv));
    for (int64_t e = whole; e < d; e++) out[i][e] = tail[i][e - whole] / l[i];
  }
}

/* att_values_ with the common counts and widths as constants. */
static void att_values(float *const *p, const float *l, int count, int64_t n, const char *v,
                       int64_t vc, int64_t d, int type, float *const *out) {
#define ATT_CASE(C, D) if (count == C && d == D) { att_values_(p, l, C, n, v, vc, D, type, out); return; }
  ATT_CASE(1, 64) ATT_CASE(2, 64) ATT_CASE(3, 64) ATT_CASE(4, 64)
  ATT_CASE(1, 128) ATT_CASE(2, 128) ATT_CASE(3, 128) ATT_CASE(4, 128)
#undef ATT_CASE
  att_values_(p, l, count, n, v, vc, d, type, out);
}

/* The keys of columns [c0, c0 + LANES) of one head as float32, a column a lane:
   tile[e * LANES + lane] (zeros past `end`: their scores are never read). */
static inline void att_tile(float *tile, const char *k, int type, int64_t kc, int64_t c0,
                            int64_t end, int64_t d) {
  for (int lane = 0; lane < LANES; lane++) {
    if (c0 + lane >= end) {
      for (int64_t e = 0; e < d; e++) tile[e * LANES + lane] = 0.0f;
      continue;
    }
    const char *kj = k + (c0 + lane) * kc * (type == F32 ? 4 : 2);
    if (type == F32)
      for (int64_t e = 0; e < d; e++) tile[e * LANES + lane] = ((const float *)kj)[e];
    else
      for (int64_t e = 0; e < d; e++) tile[e * LANES + lane] = load_w1(kj, e, type);
  }
}

/* out [B, Hq, T, d] float32: each query (b, h, t) of q [B, Hq, T, d] (float32) over
   columns [lo, hi) of sequence b's KV head h / group. Key j of head g of sequence b at
   k + b * kb + g * kh + j * kc elements, value j at v + b * vb + g * vh + j * vc (both of
   `type`, d contiguous: a KV cache's rows as they lie, nothing transposed or copied by
   the caller). lo, hi [B, Hm, T]: Hm 1 (every head's) or Hq. 0, or -1 where no memory was
   left for the scores. One call takes a whole batch (a decode step's rows: one call a
   layer). rows [B] (or NULL: sequence b reads row b): the KV row each sequence reads, at
   k + rows[b] * kb (a packed forward's tokens, each over its own row of the cache). */
int rowdot_attention(const float *q, int64_t B, int64_t Hq, int64_t T, int64_t d,
                     const void *k, const void *v, int type, int64_t kb, int64_t kh,
                     int64_t kc, int64_t vb, int64_t vh, int64_t vc, int64_t group,
                     const int64_t *lo_all, const int64_t *hi_all, int64_t Hm, float scale,
                     float *out_all, int threads, const int64_t *rows) {
  const int64_t Hk = Hq / group, blocks = (T + ATT_TOKENS - 1) / ATT_TOKENS, size = type == F32 ? 4 : 2;
  int failed = 0;
  _Pragma("omp parallel for schedule(dynamic) num_threads(threads)")
  for (int64_t task = 0; task < B * Hk * blocks; task++) {
    /* queries i = (t - t0) * group + head in the group: a token's heads side by side */
    const int64_t b = task / (Hk * blocks), g = task % (Hk * blocks) / blocks;
    const int64_t t0 = (task % blocks) * ATT_TOKENS;
    const int64_t t1 = t0 + ATT_TOKENS < T ? t0 + ATT_TOKENS : T, queries = (t1 - t0) * group;
    const int64_t *lo = lo_all + b * Hm * T, *hi = hi_all + b * Hm * T;
    const float *qb = q + b * Hq * T * d;
    float *out = out_all + b * Hq * T * d;
#define QAT(i) ((g * group + (i) % group) * T + t0 + (i) / group) /* query i's row of q, out */
#define AT(i) (Hm == 1 ? t0 + (i) / group : QAT(i))               /* its lo, hi */
    int64_t first = INT64_MAX, end = 0; /* the columns any query of the task reads */
    for (int64_t i = 0; i < queries; i++)
      if (hi[AT(i)] > lo[AT(i)]) {
        first = lo[AT(i)] < first ? lo[AT(i)] : first;
        end = hi[AT(i)] > end ? hi[AT(i)] : end;
      }
    const int64_t width = end > first ? end - first : 0, room = width + LANES;
    float *scores = (float *)malloc(sizeof(float) * (size_t)(queries * room));
    if (!scores) { failed = 1; continue; }
    const int64_t r = rows ? rows[b] : b; /* the KV row it reads */
    const char *kg = (const char *)k + (r * kb + g * kh) * size;
    const char *vg = (const char *)v + (r * vb + g * vh) * size;
    float tile[ATT_MAX_DIM * LANES];
    for (int64_t c0 = first; c0 < end; c0 += LANES) {
      att_tile(tile, kg, type, kc, c0, end, d);
      for (int64_t i0 = 0; i0 < queries; i0 += ATT_QK) {
        int take[ATT_QK], count = 0;
        for (int64_t i = i0; i < i0 + ATT_QK && i < queries; i++)
          if (hi[AT(i)] > c0 && lo[AT(i)] < c0 + LANES) take[count++] = (int)(i - i0);
        if (!count) continue;
        v8 acc[ATT_QK];
        const float *qs[ATT_QK];
        for (int c = 0; c < count; c++) {
          const int64_t i = i0 + take[c];
          acc[c] = v_zero();
          qs[c] = qb + QAT(i) * d;
        }
        if (count == ATT_QK)
          att_dots(acc, qs, tile, LANES, d, ATT_QK);
        else
          att_dots(acc, qs, tile, LANES, d, count);
        for (int c = 0; c < count; c++)
          v_store(scores + (i0 + take[c]) * room + (c0 - first), v_mul(acc[c], v_set1(scale)));
      }
    }
    for (int64_t i0 = 0; i0 < queries; i0 += group) { /* a token's heads */
      for (int64_t h0 = 0; h0 < group; h0 += ATT_HEADS) {
        float *p[ATT_HEADS], *o[ATT_HEADS], l[ATT_HEADS];
        int count = 0;
        const int64_t at = AT(i0 + h0), n = hi[at] > lo[at] ? hi[at] - lo[at] : 0;
        for (int64_t h = h0; h < group && h < h0 + ATT_HEADS; h++, count++) {
          const int64_t i = i0 + h, ai = AT(i), ni = hi[ai] > lo[ai] ? hi[ai] - lo[ai] : 0;
          o[count] = out + QAT(i) * d;
          p[count] = scores + i * room + (ni ? lo[ai] - first : 0);
          if (ni != n || (ni && lo[ai] != lo[at])) { /* (a mask per head: each alone) */
            l[count] = ni ? att_softmax(p[count], ni) : 1.0f;
            att_values(&p[count], &l[count], 1, ni, vg + (ni ? lo[ai] : 0) * vc * size, vc, d, type, &o[count]);
            count--;
            continue;
          }
          l[count] = n ? att_softmax(p[count], n) : 1.0f;
        }
        att_values(p, l, count, n, vg + (n ? lo[at] : 0) * vc * size, vc, d, type, o);
      }
    }
#undef AT
#undef QAT
    free(scores);
  }
  return failed ? -1 : 0;
}
