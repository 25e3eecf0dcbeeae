/* The native decode step: one token per row (B small) of a Llama-architecture layer, fp16 weights; and the
 * matrix product of prefill-sized inputs (`envace_gemm`, many rows) with the same weights.
 *
 * Compiled at run time by model_backend/native.py (cc -O3 -march=native -fopenmp) and called through
 * ctypes, which lets go of the GIL for each call. OpenMP here is the libgomp torch already loaded, so
 * `torch.set_num_threads` sets these threads too. x86-64 with AVX2, FMA and F16C only.
 *
 * Arithmetic: fp16 weights widened to fp32 exactly (F16C), products and sums in fp32, as fbgemm's fp16
 * kernel does; only the order of the sums differs, so logits match the torch path to float rounding.
 *
 * Layouts (all row-major, fp32 unless said): x [B, hidden]; weights fp16 [out, in] as nn.Linear keeps
 * them, q/k/v projections concatenated (qkv) and gate/up concatenated (gate_up); q [B, heads, dim], the
 * query heads of one key/value head adjacent (head = kv * groups + g); k, v [B, kv heads, dim].
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_hadd_ps(lo, lo);
    lo = _mm_hadd_ps(lo, lo);
    return _mm_cvtss_f32(lo);
}

static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* exp of 8 floats (Cephes' polynomial, as avx_mathfun has it; within 2 ulp of expf); -inf gives 0. */
static inline __m256 exp8(__m256 x) {
    __m256 zero_at = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f)), _mm256_set1_ps(-88.3762626647949f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500E-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
    __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(zero_at, _mm256_mul_ps(y, _mm256_castsi256_ps(n)));
}

/* The sums of four vectors' lanes: [sum(a), sum(b), sum(c), sum(d)]. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* One row of x: four independent sums, so that the FMAs' latency does not bound the weights' read. */
static inline float dot_one(const uint16_t *w, const float *x, int K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        _mm_prefetch((const char *)(w + k) + 1024, _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(load_f16(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_f16(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(load_f16(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(load_f16(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k < K; k += 16) {
        a0 = _mm256_fmadd_ps(load_f16(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(load_f16(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    }
    return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

/* One row of x against four weight rows far apart (w + j * gap, j < 4): four streams from memory at once. One
 * stream a core (a row after a row) read the weights at 21-25 GB/s of the two cores; four at 33-36, about what
 * the memory gives (a microbenchmark of all 30 layers' post-attention products: 7.2 -> 5.1 ms; the head 2.0 ->
 * 1.4 ms). Each sum is one chain of FMAs over k; the four chains hide each other's latency. */
static inline void dot_four(const uint16_t *w, long gap, const float *x, int K, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const uint16_t *w1 = w + gap, *w2 = w + 2 * gap, *w3 = w + 3 * gap;
    for (int k = 0; k < K; k += 16) {
        if ((k & 31) == 0) { /* a cache line of each row, 512 bytes ahead */
            _mm_prefetch((const char *)(w + k) + 512, _MM_HINT_T0);
            _mm_prefetch((const char *)(w1 + k) + 512, _MM_HINT_T0);
            _mm_prefetch((const char *)(w2 + k) + 512, _MM_HINT_T0);
            _mm_prefetch((const char *)(w3 + k) + 512, _MM_HINT_T0);
        }
        __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
        a0 = _mm256_fmadd_ps(load_f16(w + k + 8), x1, _mm256_fmadd_ps(load_f16(w + k), x0, a0));
        a1 = _mm256_fmadd_ps(load_f16(w1 + k + 8), x1, _mm256_fmadd_ps(load_f16(w1 + k), x0, a1));
        a2 = _mm256_fmadd_ps(load_f16(w2 + k + 8), x1, _mm256_fmadd_ps(load_f16(w2 + k), x0, a2));
        a3 = _mm256_fmadd_ps(load_f16(w3 + k + 8), x1, _mm256_fmadd_ps(load_f16(w3 + k), x0, a3));
    }
    _mm_storeu_ps(out, hsum4(a0, a1, a2, a3));
}

/* A tile of dot products: `rows` (1-4, a constant where inlined) rows of x with three fp16 weight rows
 * w + j * gap (j < 3), out[m * 3 + j] = sum_k w[j * gap + k] * x[m * K + k]. Twelve sums in registers at four
 * rows: each widened weight vector serves every row and each x vector every weight row, so the FMAs, not the
 * loads, bound it (one weight row a time, re-reading x for each, ran at 60-80 GFLOPS of the CPU's ~208 at 4-16
 * rows). The three weight rows lie far apart (three streams from memory), each read 512 bytes ahead. */
static inline __attribute__((always_inline)) void dot_tile(const uint16_t *w, long gap, const float *x, int K,
                                                           float *out, const int rows) {
    __m256 acc[4][3];
    for (int m = 0; m < rows; m++) acc[m][0] = acc[m][1] = acc[m][2] = _mm256_setzero_ps();
    for (int k = 0; k < K; k += 8) {
        __m256 w0 = load_f16(w + k), w1 = load_f16(w + gap + k), w2 = load_f16(w + 2 * gap + k);
        if ((k & 31) == 0)
            for (int j = 0; j < 3; j++) _mm_prefetch((const char *)(w + j * gap + k) + 512, _MM_HINT_T0);
        for (int m = 0; m < rows; m++) {
            __m256 xv = _mm256_loadu_ps(x + (long)m * K + k);
            __asm__("" : "+x"(xv)); /* one load of x for the three FMAs, not one folded into each */
            acc[m][0] = _mm256_fmadd_ps(w0, xv, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(w1, xv, acc[m][1]);
            acc[m][2] = _mm256_fmadd_ps(w2, xv, acc[m][2]);
        }
    }
    for (int m = 0; m < rows; m++)
        for (int j = 0; j < 3; j++) out[m * 3 + j] = hsum(acc[m][j]);
}

static void gemm(int M, int N, int K, const float *X, const uint16_t *W, float *Y, int accumulate);

#define GEMV_MAX_ROWS 32

/* y[m, n] (+)= sum_k x[m, k] * W[n, k], for m < M; K a multiple of 16. Each thread takes a contiguous range of
 * weight rows and reads it as several streams at once (its quarters or thirds): one stream a thread reached
 * 21-25 GB/s, several 30-36. One row of x: four weight rows a time (`dot_four`), bound by the weights' read.
 * 2-32 rows (GEMV_MAX_ROWS): tiles of three weight rows by up to four rows of x (`dot_tile`), each weight
 * block read from memory once for all M rows (the next rows re-read it from L1); 30 layers' post-attention
 * products took 9.1 -> 6.6 ms at two rows, 9.4 -> 8.0 at four. More rows: the packed product (`gemm`). */
static void gemv(const uint16_t *W, const float *x, float *y, int M, int N, int K, int accumulate) {
    if (M <= 0) return;
    if (M > GEMV_MAX_ROWS && N % 16 == 0) {
        gemm(M, N, K, x, W, y, accumulate);
        return;
    }
    if (M == 1) { /* each thread a contiguous range of weight rows, read as four streams (its quarters) */
#pragma omp parallel
        {
            int threads = omp_get_num_threads(), t = omp_get_thread_num();
            int n0 = (int)((long)N * t / threads), n1 = (int)((long)N * (t + 1) / threads), quarter = (n1 - n0) / 4;
            for (int i = 0; i < quarter; i++) {
                float out[4];
                dot_four(W + (long)(n0 + i) * K, (long)quarter * K, x, K, out);
                for (int j = 0; j < 4; j++) {
                    float *o = y + n0 + j * quarter + i;
                    *o = accumulate ? *o + out[j] : out[j];
                }
            }
            for (int n = n0 + 4 * quarter; n < n1; n++) {
                float out = dot_one(W + (long)n * K, x, K);
                y[n] = accumulate ? y[n] + out : out;
            }
        }
        return;
    }
    int chunks = (M + 3) / 4, base = M / chunks, extra = M % chunks; /* M rows in near-equal chunks of <= 4 */
#pragma omp parallel
    {
        /* each thread a contiguous range of weight rows in thirds: tile i takes row i of each third */
        int threads = omp_get_num_threads(), t = omp_get_thread_num();
        int n0 = (int)((long)N * t / threads), n1 = (int)((long)N * (t + 1) / threads), third = (n1 - n0) / 3;
        for (int i = 0; i < third; i++) {
            const uint16_t *w = W + (long)(n0 + i) * K;
            for (int c = 0, m0 = 0; c < chunks; c++) {
                int rows = base + (c < extra);
                const float *xm = x + (long)m0 * K;
                float out[12];
                switch (rows) {
                    case 1: dot_tile(w, (long)third * K, xm, K, out, 1); break;
                    case 2: dot_tile(w, (long)third * K, xm, K, out, 2); break;
                    case 3: dot_tile(w, (long)third * K, xm, K, out, 3); break;
                    default: dot_tile(w, (long)third * K, xm, K, out, 4); break;
                }
                for (int m = 0; m < rows; m++)
                    for (int j = 0; j < 3; j++) {
                        float *o = y + (long)(m0 + m) * N + n0 + j * third + i;
                        *o = accumulate ? *o + out[m * 3 + j] : out[m * 3 + j];
                    }
                m0 += rows;
            }
        }
        for (int n = n0 + 3 * third; n < n1; n++) /* the thread's last one or two weight rows: one at a time */
            for (int m = 0; m < M; m++) {
                float out = dot_one(W + (long)n * K, x + (long)m * K, K);
                float *o = y + (long)m * N + n;
                *o = accumulate ? *o + out : out;
            }
    }
}

/* out = weight * (x * rsqrt(mean(x^2) + eps)), LlamaRMSNorm's formula, per row. */
static void rms_norm(const float *x, const float *weight, float eps, float *out, int M, int H) {
    for (int m = 0; m < M; m++) {
        const float *xm = x + (long)m * H;
        float ss = 0.f;
        for (int i = 0; i < H; i++) ss += xm[i] * xm[i];
        float r = 1.f / sqrtf(ss / H + eps);
        for (int i = 0; i < H; i++) out[(long)m * H + i] = weight[i] * (xm[i] * r);
    }
}

/* Rotary embedding of one head in place: x * cos + rotate_half(x) * sin. */
static void rope(float *x, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Before attention: h = rms_norm(x); [q | k | v] = h @ qkv^T; rotary on q and k (cos, sin: [B, dim]).
 * scratch: B * (hidden + (heads + 2 * kv) * dim) floats. */
void envace_pre_attention(int B, int hidden, int heads, int kv, int dim, const float *x, const float *norm_w,
                          float eps, const uint16_t *qkv, const float *cos, const float *sin, float *q, float *k,
                          float *v, float *scratch) {
    int width = (heads + 2 * kv) * dim;
    float *h = scratch, *fused = scratch + (long)B * hidden;
    rms_norm(x, norm_w, eps, h, B, hidden);
    gemv(qkv, h, fused, B, width, hidden, 0);
    for (int b = 0; b < B; b++) {
        const float *f = fused + (long)b * width;
        for (int i = 0; i < heads * dim; i++) q[(long)b * heads * dim + i] = f[i];
        for (int i = 0; i < kv * dim; i++) {
            k[(long)b * kv * dim + i] = f[heads * dim + i];
            v[(long)b * kv * dim + i] = f[(heads + kv) * dim + i];
        }
        for (int hd = 0; hd < heads; hd++) rope(q + ((long)b * heads + hd) * dim, cos + (long)b * dim, sin + (long)b * dim, dim);
        for (int hd = 0; hd < kv; hd++) rope(k + ((long)b * kv + hd) * dim, cos + (long)b * dim, sin + (long)b * dim, dim);
    }
}

/* Softmax weights of one query's scores in place: sg[t] = exp(sg[t] - max) (0 for a masked key, -inf);
 * returns their sum. */
static inline float exp_weights(float *sg, int n, float max) {
    __m256 m = _mm256_set1_ps(max), total = _mm256_setzero_ps();
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), m));
        _mm256_storeu_ps(sg + t, p);
        total = _mm256_add_ps(total, p);
    }
    float rest = 0.f;
    for (; t < n; t++) {
        float p = sg[t] == -INFINITY ? 0.f : expf(sg[t] - max);
        sg[t] = p;
        rest += p;
    }
    return hsum(total) + rest;
}

/* Part of one query group's attention over keys [t0, t1) of one sequence of keys: its max score, the sum of
 * exp(score - max) and the exp-weighted sum of values, per query of the group. Masked keys (mask[t] == 0)
 * are skipped; a part with no visible key gets max = -inf. Inlined with dim a constant where it is 64, so
 * that the loops over dim unroll and the sums stay in registers. */
static inline __attribute__((always_inline)) void attend_part_dim(
        const float *q, int groups, const int dim, const float *keys, const float *values, long stride,
        const uint8_t *mask, int t0, int t1, float scale, float *max, float *sum, float *acc, float *scores) {
    for (int g = 0; g < groups; g++) { max[g] = -INFINITY; sum[g] = 0.f; }
    for (int i = 0; i < groups * dim; i++) acc[i] = 0.f;
    int n = t1 - t0;
    /* scores, eight keys at a time: eight independent sums per query (no long chain of FMAs), their lanes
     * summed together, masked keys set to -inf */
    int t = 0;
    __m256 vmax[16];
    for (int g = 0; g < groups; g++) vmax[g] = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= n; t += 8) {
        const float *k0 = keys + (long)(t0 + t) * stride;
        __m256 hidden = _mm256_setzero_ps();
        if (mask) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(mask + t0 + t));
            hidden = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_cvtepu8_epi32(bytes), _mm256_setzero_si256()));
        }
        for (int g = 0; g < groups; g++) {
            const float *qg = q + g * dim;
            __m256 a[8];
            for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) {
                __m256 qd = _mm256_loadu_ps(qg + d);
                for (int i = 0; i < 8; i++) a[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + i * stride + d), a[i]);
            }
            __m128 lo = hsum4(a[0], a[1], a[2], a[3]), hi = hsum4(a[4], a[5], a[6], a[7]);
            __m256 sc = _mm256_mul_ps(_mm256_set_m128(hi, lo), _mm256_set1_ps(scale));
            sc = _mm256_blendv_ps(sc, _mm256_set1_ps(-INFINITY), hidden);
            _mm256_storeu_ps(scores + g * n + t, sc);
            vmax[g] = _mm256_max_ps(vmax[g], sc);
        }
    }
    for (int g = 0; g < groups; g++) {
        float lanes[8];
        _mm256_storeu_ps(lanes, vmax[g]);
        for (int i = 0; i < 8; i++) if (lanes[i] > max[g]) max[g] = lanes[i];
    }
    for (; t < n; t++) {
        float *st = scores + t;
        if (mask && !mask[t0 + t]) {
            for (int g = 0; g < groups; g++) st[g * n] = -INFINITY;
            continue;
        }
        const float *kt = keys + (long)(t0 + t) * stride;
        for (int g = 0; g < groups; g++) {
            __m256 a = _mm256_setzero_ps();
            for (int d = 0; d < dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * dim + d), _mm256_loadu_ps(kt + d), a);
            float sc = hsum(a) * scale;
            st[g * n] = sc;
            if (sc > max[g]) max[g] = sc;
        }
    }
    for (int g = 0; g < groups; g++) {
        if (max[g] == -INFINITY) continue;
        float *sg = scores + g * n;
        sum[g] = exp_weights(sg, n, max[g]);
        /* the weighted values: this query's sums in registers (dim / 8 of them), one broadcast weight a key */
        __m256 o[16];
        for (int d = 0; d < dim; d += 8) o[d / 8] = _mm256_setzero_ps();
        for (int t = 0; t < n; t++) {
            if (sg[t] == 0.f) continue;
            const float *vt = values + (long)(t0 + t) * stride;
            __m256 pv = _mm256_set1_ps(sg[t]);
            for (int d = 0; d < dim; d += 8) o[d / 8] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + d), o[d / 8]);
        }
        for (int d = 0; d < dim; d += 8) _mm256_storeu_ps(acc + g * dim + d, o[d / 8]);
    }
}

/* Scores of `gc` (1-3, a constant where inlined) query vectors against four keys: twelve sums in registers, so
 * that each key vector loaded serves every query (one query at a time re-read each key from L1 per query). */
static inline __attribute__((always_inline)) void scores_4keys(const float *q, const int gc, const float *k0,
                                                               long stride, float scale, __m128 hidden, float *out,
                                                               long out_stride, __m128 *vmax) {
    __m256 acc[3][4];
    for (int g = 0; g < gc; g++) acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = _mm256_setzero_ps();
    for (int d = 0; d < 64; d += 8) {
        __m256 ka = _mm256_loadu_ps(k0 + d), kb = _mm256_loadu_ps(k0 + stride + d);
        __m256 kc = _mm256_loadu_ps(k0 + 2 * stride + d), kd = _mm256_loadu_ps(k0 + 3 * stride + d);
        for (int g = 0; g < gc; g++) {
            __m256 qv = _mm256_loadu_ps(q + g * 64 + d);
            acc[g][0] = _mm256_fmadd_ps(qv, ka, acc[g][0]);
            acc[g][1] = _mm256_fmadd_ps(qv, kb, acc[g][1]);
            acc[g][2] = _mm256_fmadd_ps(qv, kc, acc[g][2]);
            acc[g][3] = _mm256_fmadd_ps(qv, kd, acc[g][3]);
        }
    }
    for (int g = 0; g < gc; g++) {
        __m128 sc = _mm_mul_ps(hsum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]), _mm_set1_ps(scale));
        sc = _mm_blendv_ps(sc, _mm_set1_ps(-INFINITY), hidden);
        _mm_storeu_ps(out + g * out_stride, sc);
        vmax[g] = _mm_max_ps(vmax[g], sc);
    }
}

/* The exp-weighted sums of values for `gc` (1-3) query vectors, half of the 64 dims (d0) at a time: each value
 * vector loaded serves every query. p: the queries' weights, row stride n. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, long n, const int gc,
                                                               const float *values, long stride, int d0, float *acc) {
    __m256 o[3][4];
    for (int g = 0; g < gc; g++) o[g][0] = o[g][1] = o[g][2] = o[g][3] = _mm256_setzero_ps();
    for (long t = 0; t < n; t++) {
        const float *vt = values + t * stride + d0;
        if (d0 == 0) /* the whole value row 8 ahead (the second half's pass finds it cached) */
            for (int line = 0; line < 4; line++) _mm_prefetch((const char *)(vt + 8 * stride + 16 * line), _MM_HINT_T0);
        __m256 va = _mm256_loadu_ps(vt), vb = _mm256_loadu_ps(vt + 8);
        __m256 vc = _mm256_loadu_ps(vt + 16), vd = _mm256_loadu_ps(vt + 24);
        for (int g = 0; g < gc; g++) {
            __m256 pv = _mm256_broadcast_ss(p + g * n + t);
            o[g][0] = _mm256_fmadd_ps(pv, va, o[g][0]);
            o[g][1] = _mm256_fmadd_ps(pv, vb, o[g][1]);
            o[g][2] = _mm256_fmadd_ps(pv, vc, o[g][2]);
            o[g][3] = _mm256_fmadd_ps(pv, vd, o[g][3]);
        }
    }
    for (int g = 0; g < gc; g++)
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(acc + g * 64 + d0 + 8 * j, o[g][j]);
}

/* `attend_part_dim` for dim 64 (SmolLM2's and most small Llamas'), with the query vectors three at a time:
 * keys four at a time against all three (`scores_4keys`) and values, half the dims at a time, weighed for all
 * three (`weigh_values`). At one row of 1,047 keys the scores and weighted values are where the attention's
 * time went, each key re-read from L1 once per query. */
static void attend_part_64(const float *q, int groups, const float *keys, const float *values, long stride,
                           const uint8_t *mask, int t0, int t1, float scale, float *max, float *sum, float *acc,
                           float *scores) {
    int n = t1 - t0, t = 0;
    for (int g0 = 0; g0 < groups; g0 += 3) {
        int gc = groups - g0 < 3 ? groups - g0 : 3;
        __m128 vmax[3] = {_mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY), _mm_set1_ps(-INFINITY)};
        for (t = 0; t + 4 <= n; t += 4) {
            __m128 hidden = _mm_setzero_ps();
            if (mask) {
                int four;
                memcpy(&four, mask + t0 + t, sizeof four); /* the four keys' mask bytes */
                __m128i bytes = _mm_cvtsi32_si128(four);
                hidden = _mm_castsi128_ps(_mm_cmpeq_epi32(_mm_cvtepu8_epi32(bytes), _mm_setzero_si128()));
            }
            const float *k0 = keys + (long)(t0 + t) * stride;
            for (int r = 0; r < 4; r++) /* keys 16 ahead: the parts stream from memory */
                for (int line = 0; line < 4; line++)
                    _mm_prefetch((const char *)(k0 + (16 + r) * stride + 16 * line), _MM_HINT_T0);
            const float *qg = q + g0 * 64;
            float *out = scores + (long)g0 * n + t;
            switch (gc) {
                case 1: scores_4keys(qg, 1, k0, stride, scale, hidden, out, n, vmax); break;
                case 2: scores_4keys(qg, 2, k0, stride, scale, hidden, out, n, vmax); break;
                default: scores_4keys(qg, 3, k0, stride, scale, hidden, out, n, vmax); break;
            }
        }
        for (int g = 0; g < gc; g++) {
            float lanes[4];
            _mm_storeu_ps(lanes, vmax[g]);
            float m = -INFINITY;
            for (int i = 0; i < 4; i++) if (lanes[i] > m) m = lanes[i];
            max[g0 + g] = m;
        }
    }
    for (int g = 0; g < groups; g++) { /* the last n % 4 keys */
        for (int u = t; u < n; u++) {
            float sc = -INFINITY;
            if (!mask || mask[t0 + u]) {
                const float *ku = keys + (long)(t0 + u) * stride;
                __m256 a = _mm256_setzero_ps();
                for (int d = 0; d < 64; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * 64 + d), _mm256_loadu_ps(ku + d), a);
                sc = hsum(a) * scale;
            }
            scores[(long)g * n + u] = sc;
            if (sc > max[g]) max[g] = sc;
        }
        if (n == 0) max[g] = -INFINITY;
    }
    for (int g = 0; g < groups; g++) {
        float *sg = scores + (long)g * n;
        if (max[g] == -INFINITY) { /* nothing visible: weights 0 */
            sum[g] = 0.f;
            for (int u = 0; u < n; u++) sg[u] = 0.f;
            continue;
        }
        sum[g] = exp_weights(sg, n, max[g]);
    }
    const float *v0 = values + (long)t0 * stride;
    for (int g0 = 0; g0 < groups; g0 += 3) {
        int gc = groups - g0 < 3 ? groups - g0 : 3;
        for (int d0 = 0; d0 < 64; d0 += 32) {
            const float *p = scores + (long)g0 * n;
            float *a = acc + g0 * 64;
            switch (gc) {
                case 1: weigh_values(p, n, 1, v0, stride, d0, a); break;
                case 2: weigh_values(p, n, 2, v0, stride, d0, a); break;
                default: weigh_values(p, n, 3, v0, stride, d0, a); break;
            }
        }
    }
}

static void attend_part(const float *q, int groups, int dim, const float *keys, const float *values, long stride,
                        const uint8_t *mask, int t0, int t1, float scale, float *max, float *sum, float *acc,
                        float *scores) {
    if (dim == 64)
        attend_part_64(q, groups, keys, values, stride, mask, t0, t1, scale, max, sum, acc, scores);
    else
        attend_part_dim(q, groups, dim, keys, values, stride, mask, t0, t1, scale, max, sum, acc, scores);
}

/* Attention of N queries (each the query heads of one new token) over [a prefix all rows share (P keys) |
 * their row's own keys]. shared_k/v: [kv, P, dim] with head stride shared_hs (P = 0: none); own_k/v:
 * [B, kv, S, dim] with batch stride own_bs and head stride own_hs; own_mask: [B, S] (1 = visible) or NULL.
 * Query n belongs to row row_of[n] and sees that row's first limit[n] own keys (causality among the new
 * tokens of a row); row_of = NULL means query n is row n, limit = NULL all S keys. out: [N, heads, dim].
 *
 * The shared prefix runs as cascade attention: a task takes one key/value head and one part of the prefix
 * for the queries of all N tokens at once, so each prefix key is read once a step, not once a row (K rows
 * of one prompt read it K times before: 9.3 ms a token at four rows against 3.6 at one). The own keys go
 * a task per query, head and part. Keys are cut into parts so that both threads have work at batch 1;
 * every part's softmax (max, sum, weighted values) merges exactly with the others at the end. */
#define QCHUNK 16
void envace_attention(int N, int kv, int groups, int dim, const float *q, const float *shared_k,
                      const float *shared_v, long shared_hs, int P, const float *own_k, const float *own_v,
                      long own_bs, long own_hs, int S, const uint8_t *own_mask, const int *row_of, const int *limit,
                      float scale, float *out) {
    int shared_parts = 0, own_parts = (S + 127) / 128;
    if (P > 0) {
        shared_parts = (P + 255) / 256;
        int want = (16 + kv - 1) / kv;
        if (shared_parts > want) shared_parts = want;
    }
    int want_own = (16 + N * kv - 1) / (N * kv);
    if (own_parts > want_own) own_parts = want_own;
    if (own_parts < 1) own_parts = 1;
    int slots = shared_parts + own_parts;
    int shared_span = shared_parts ? (P + shared_parts - 1) / shared_parts : 0;
    int own_span = (S + own_parts - 1) / own_parts;
    int span = shared_span > own_span ? shared_span : own_span;
    long cells = (long)N * kv * slots * groups; /* one (query, head, group, slot) each */
    float *max = malloc(sizeof(float) * cells), *sum = malloc(sizeof(float) * cells);
    float *acc = malloc(sizeof(float) * cells * dim);
    int vectors = N * groups; /* the query vectors of one kv head: every token's groups */
#pragma omp parallel
    {
        float *scores = malloc(sizeof(float) * QCHUNK * (span + 8));
        float *qs = malloc(sizeof(float) * QCHUNK * dim);
        float mx[QCHUNK], sm[QCHUNK], *ac = malloc(sizeof(float) * QCHUNK * dim);
#pragma omp for schedule(static) nowait
        for (int task = 0; task < kv * shared_parts; task++) {
            int h = task / shared_parts, part = task % shared_parts;
            int t0 = part * shared_span, t1 = t0 + shared_span < P ? t0 + shared_span : P;
            for (int v0 = 0; v0 < vectors; v0 += QCHUNK) {
                int count = vectors - v0 < QCHUNK ? vectors - v0 : QCHUNK;
                for (int j = 0; j < count; j++) { /* vector v0 + j: token n's query group g of head h */
                    int n = (v0 + j) / groups, g = (v0 + j) % groups;
                    memcpy(qs + j * dim, q + (((long)n * kv + h) * groups + g) * dim, sizeof(float) * dim);
                }
                attend_part(qs, count, dim, shared_k + h * shared_hs, shared_v + h * shared_hs, dim, NULL, t0, t1,
                            scale, mx, sm, ac, scores);
                for (int j = 0; j < count; j++) {
                    int n = (v0 + j) / groups, g = (v0 + j) % groups;
                    long cell = (((long)n * kv + h) * slots + part) * groups + g;
                    max[cell] = mx[j];
                    sum[cell] = sm[j];
                    memcpy(acc + cell * dim, ac + j * dim, sizeof(float) * dim);
                }
            }
        }
#pragma omp for schedule(static)
        for (int task = 0; task < N * kv * own_parts; task++) {
            int n = task / (kv * own_parts), h = (task / own_parts) % kv, part = task % own_parts;
            int b = row_of ? row_of[n] : n, end = limit ? limit[n] : S;
            int t0 = part * own_span, t1 = t0 + own_span < end ? t0 + own_span : end;
            if (t0 > t1) t0 = t1; /* a part past this query's last key: nothing to see */
            long cell = (((long)n * kv + h) * slots + shared_parts + part) * groups;
            attend_part(q + ((long)n * kv + h) * groups * dim, groups, dim, own_k + b * own_bs + h * own_hs,
                        own_v + b * own_bs + h * own_hs, dim, own_mask ? own_mask + (long)b * S : NULL, t0, t1, scale,
                        max + cell, sum + cell, acc + cell * dim, scores);
        }
        free(scores);
        free(qs);
        free(ac);
    }
    for (int n = 0; n < N; n++)
        for (int h = 0; h < kv; h++)
            for (int g = 0; g < groups; g++) {
                long first = ((long)n * kv + h) * slots * groups + g; /* slot s at first + s * groups */
                float m = -INFINITY, s = 0.f;
                for (int slot = 0; slot < slots; slot++)
                    if (max[first + slot * groups] > m) m = max[first + slot * groups];
                float *o = out + (((long)n * kv + h) * groups + g) * dim;
                for (int d = 0; d < dim; d++) o[d] = 0.f;
                if (m == -INFINITY) continue; /* nothing visible: zeros, as the torch path's merge gives */
                for (int slot = 0; slot < slots; slot++) {
                    long cell = first + slot * groups;
                    if (max[cell] == -INFINITY) continue;
                    float c = expf(max[cell] - m);
                    s += sum[cell] * c;
                    for (int d = 0; d < dim; d++) o[d] += acc[cell * dim + d] * c;
                }
                for (int d = 0; d < dim; d++) o[d] /= s;
            }
    free(max);
    free(sum);
    free(acc);
}

/* After attention: x += a @ o^T; h = rms_norm(x); [gate | up] = h @ gate_up^T; x += (silu(gate) * up) @ down^T.
 * x is updated in place. scratch: B * (hidden + 2 * mlp) floats. */
void envace_post_attention(int B, int hidden, int mlp, float *x, const float *a, const uint16_t *o_proj,
                           const float *norm_w, float eps, const uint16_t *gate_up, const uint16_t *down,
                           float *scratch) {
    float *h = scratch, *gu = scratch + (long)B * hidden;
    gemv(o_proj, a, x, B, hidden, hidden, 1);
    rms_norm(x, norm_w, eps, h, B, hidden);
    gemv(gate_up, h, gu, B, 2 * mlp, hidden, 0);
    for (int b = 0; b < B; b++) {
        float *g = gu + (long)b * 2 * mlp, *u = g + mlp, *act = gu + (long)b * mlp;
        /* act overwrites the gate of row b in place: row b's act lies at or before its gate */
        for (int i = 0; i < mlp; i++) {
            float gi = g[i];
            act[i] = gi / (1.f + expf(-gi)) * u[i];
        }
    }
    gemv(down, gu, x, B, hidden, mlp, 1);
}

/* A decode step of B rows (one new token each, every row live) through all L layers in one call, keys and
 * values written into the cache's buffers: per layer, ptrs[l] = {input norm, qkv, o_proj, post norm, gate_up,
 * down, key buffer, value buffer} ([B, kv, capacity, dim] buffers, batch stride own_bs, head stride own_hs,
 * the new token at own index `pos`), eps[l] = {input eps, post eps}, shared[l] = {prefix keys, values} or
 * {0, 0} (P = 0), own_mask [B, pos + 1] (1 = visible) or NULL. The same arithmetic as the three calls a layer; at batch 1 the Python between those calls
 * (90 calls, 30 cache appends a token) cost about a millisecond a token. q, k, v, a, scratch as there. */
void envace_decode_layers(int L, int B, int hidden, int heads, int kv, int dim, int mlp, float *x,
                          const float *cos, const float *sin, const int64_t *ptrs, const float *eps,
                          const int64_t *shared, long shared_hs, int P, long own_bs, long own_hs, int pos,
                          const uint8_t *own_mask, float scale, float *q, float *k, float *v, float *a,
                          float *scratch) {
    for (int l = 0; l < L; l++) {
        const int64_t *w = ptrs + 8L * l;
        float *k_buf = (float *)w[6], *v_buf = (float *)w[7];
        envace_pre_attention(B, hidden, heads, kv, dim, x, (const float *)w[0], eps[2 * l], (const uint16_t *)w[1],
                             cos, sin, q, k, v, scratch);
        for (int b = 0; b < B; b++)
            for (int h = 0; h < kv; h++) {
                long at = b * own_bs + h * own_hs + (long)pos * dim;
                memcpy(k_buf + at, k + ((long)b * kv + h) * dim, sizeof(float) * dim);
                memcpy(v_buf + at, v + ((long)b * kv + h) * dim, sizeof(float) * dim);
            }
        envace_attention(B, kv, heads / kv, dim, q, P ? (const float *)shared[2 * l] : NULL,
                         P ? (const float *)shared[2 * l + 1] : NULL, shared_hs, P, k_buf, v_buf, own_bs, own_hs,
                         pos + 1, own_mask, NULL, NULL, scale, a);
        envace_post_attention(B, hidden, mlp, x, a, (const uint16_t *)w[2], (const float *)w[3], eps[2 * l + 1],
                              (const uint16_t *)w[4], (const uint16_t *)w[5], scratch);
    }
}

/* The head: logits = rms_norm(x) @ head^T. scratch: B * hidden floats. */
void envace_head(int B, int hidden, int vocab, const float *x, const float *norm_w, float eps,
                 const uint16_t *head, float *logits, float *scratch) {
    rms_norm(x, norm_w, eps, scratch, B, hidden);
    gemv(head, scratch, logits, B, vocab, hidden, 0);
}

/* ---------------------------------------------------------------- envace_gemm: products of many rows
 *
 * Y[M, N] = X[M, K] . W[N, K]^T for prefills, token trees and scoring passes (M > 16 rows), where fbgemm's
 * fp16 product reached 100-150 GFLOPS of this CPU's ~208 peak. The GotoBLAS/BLIS scheme: per thread, blocks
 * of NC weight rows and KC of K are widened to fp32 and packed k-major in panels of 16 columns (L2), and a
 * 6x16 register tile (12 accumulators) runs over 6 rows of X at a time, broadcasting one x per row and k.
 * Sums are fp32 over K in blocks of KC: the same products as fbgemm's, added in another order.
 * Needs N a multiple of 16 and K of 8. */

#define GEMM_MR 6
#define GEMM_NR 16
#define GEMM_KC 256
#define GEMM_NC 96

static inline void transpose8(__m256 r[8]) {
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20); r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20); r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31); r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31); r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* The panel of weight rows n0..n0+15 over k0..k0+kc, widened and transposed: panel[k][16]. */
static void pack_panel(const uint16_t *W, long K, int n0, int k0, int kc, float *panel) {
    for (int k = 0; k < kc; k += 8)
        for (int half = 0; half < 2; half++) {
            __m256 r[8];
            for (int j = 0; j < 8; j++) r[j] = load_f16(W + (long)(n0 + half * 8 + j) * K + k0 + k);
            transpose8(r);
            for (int kk = 0; kk < 8; kk++) _mm256_store_ps(panel + (k + kk) * GEMM_NR + half * 8, r[kk]);
        }
}

/* C[6, 16] (row stride ldc) = (accumulate ? C : 0) + x[6, kc] (row stride ldx) . panel[kc, 16]. */
static inline __attribute__((always_inline)) void tile_6x16(int kc, const float *x, long ldx, const float *panel,
                                                            float *c, long ldc, int accumulate) {
    __m256 c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51;
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx, *x4 = x + 4 * ldx, *x5 = x + 5 * ldx;
    for (int k = 0; k < kc; k++) {
        __m256 b0 = _mm256_load_ps(panel + k * GEMM_NR), b1 = _mm256_load_ps(panel + k * GEMM_NR + 8);
        __m256 a = _mm256_broadcast_ss(x0 + k);
        c00 = _mm256_fmadd_ps(a, b0, c00); c01 = _mm256_fmadd_ps(a, b1, c01);
        a = _mm256_broadcast_ss(x1 + k);
        c10 = _mm256_fmadd_ps(a, b0, c10); c11 = _mm256_fmadd_ps(a, b1, c11);
        a = _mm256_broadcast_ss(x2 + k);
        c20 = _mm256_fmadd_ps(a, b0, c20); c21 = _mm256_fmadd_ps(a, b1, c21);
        a = _mm256_broadcast_ss(x3 + k);
        c30 = _mm256_fmadd_ps(a, b0, c30); c31 = _mm256_fmadd_ps(a, b1, c31);
        a = _mm256_broadcast_ss(x4 + k);
        c40 = _mm256_fmadd_ps(a, b0, c40); c41 = _mm256_fmadd_ps(a, b1, c41);
        a = _mm256_broadcast_ss(x5 + k);
        c50 = _mm256_fmadd_ps(a, b0, c50); c51 = _mm256_fmadd_ps(a, b1, c51);
    }
    __m256 rows[12] = {c00, c01, c10, c11, c20, c21, c30, c31, c40, c41, c50, c51};
    for (int i = 0; i < 6; i++) {
        __m256 lo = rows[2 * i], hi = rows[2 * i + 1];
        if (accumulate) {
            lo = _mm256_add_ps(lo, _mm256_loadu_ps(c + i * ldc));
            hi = _mm256_add_ps(hi, _mm256_loadu_ps(c + i * ldc + 8));
        }
        _mm256_storeu_ps(c + i * ldc, lo);
        _mm256_storeu_ps(c + i * ldc + 8, hi);
    }
}

/* Y (+)= X . W^T (accumulate: added to Y's values). */
static void gemm(int M, int N, int K, const float *X, const uint16_t *W, float *Y, int accumulate) {
    int blocks = (N + GEMM_NC - 1) / GEMM_NC;
#pragma omp parallel
    {
        static _Thread_local float panels[GEMM_NC * GEMM_KC] __attribute__((aligned(64)));
        float x_tail[GEMM_MR * GEMM_KC] __attribute__((aligned(32)));
        float c_tail[GEMM_MR * GEMM_NR] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int block = 0; block < blocks; block++) {
            int n0 = block * GEMM_NC, nc = N - n0 < GEMM_NC ? N - n0 : GEMM_NC;
            for (int k0 = 0; k0 < K; k0 += GEMM_KC) {
                int kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC, acc = accumulate || k0 > 0;
                for (int j = 0; j < nc; j += GEMM_NR) pack_panel(W, K, n0 + j, k0, kc, panels + j * kc);
                int m = 0;
                for (; m + GEMM_MR <= M; m += GEMM_MR)
                    for (int j = 0; j < nc; j += GEMM_NR)
                        tile_6x16(kc, X + (long)m * K + k0, K, panels + j * kc, Y + (long)m * N + n0 + j, N, acc);
                if (m == M) continue;
                /* The last M % 6 rows: through zero-padded copies of x and of the tile. */
                int rows = M - m;
                memset(x_tail, 0, sizeof(x_tail));
                for (int i = 0; i < rows; i++) memcpy(x_tail + i * kc, X + (long)(m + i) * K + k0, sizeof(float) * kc);
                for (int j = 0; j < nc; j += GEMM_NR) {
                    tile_6x16(kc, x_tail, kc, panels + j * kc, c_tail, GEMM_NR, 0);
                    for (int i = 0; i < rows; i++) {
                        float *y = Y + (long)(m + i) * N + n0 + j;
                        for (int q = 0; q < GEMM_NR; q++) y[q] = acc ? y[q] + c_tail[i * GEMM_NR + q] : c_tail[i * GEMM_NR + q];
                    }
                }
            }
        }
    }
}

void envace_gemm(int M, int N, int K, const float *X, const uint16_t *W, float *Y) { gemm(M, N, K, X, W, Y, 0); }
