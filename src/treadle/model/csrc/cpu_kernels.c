/* treadle's CPU kernels, compiled on first use by cpu_kernels.py (cc -O3 -march=native -fopenmp)
   and called through ctypes:

   - paged_decode_attention_f32: decode attention reading the paged KV cache in place;
   - gguf_linear_f32: y = x W^T for the few rows of a decode step, with W kept in its GGUF blocks
     (Q4_0, Q4_1, Q8_0) and expanded to float32 on the fly, so that the step reads 0.75-1.25
     bytes per weight instead of 4;
   - the small per-layer operations (RMSNorm, add + RMSNorm, RoPE, SiLU * up, the KV write).

   Each has an AVX-512 path and a portable one that the compiler vectorizes as it can. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* exp(x) for x <= 0 (Cephes' expf: Cody-Waite reduction and a degree-6 polynomial, about
   1 ulp), written so that the compiler vectorizes the loops that call it. */
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    union { int32_t i; float f; } scale;
    scale.i = ((int32_t)n + 127) << 23;
    return p * scale.f;
}

/* Ask for a block's rows ahead of use: blocks lie anywhere in the cache, so the hardware
   prefetcher cannot guess the next one. */
static inline void prefetch_block(const float* block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i, 0, 1);
}

static inline float dot(const float* a, const float* b, int64_t n) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* Softmax in place over the first `len` scores of each of `rows` rows, `stride` apart. */
static void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t stride) {
    for (int64_t j = 0; j < rows; j++) {
        float* s = scores + j * stride;
        float m = s[0];
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        float total = 0.f;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            total += s[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
}

#if defined(__AVX512F__)
#define D64_BLOCK 16                 /* tokens per cache block this path expects */
#define D64_BLOCK_FLOATS (D64_BLOCK * 64)
#define D64_MAX_GROUP 4

/* One (request, KV head) task for head size 64 and up to 4 query heads per KV head (the common
   shapes): the query heads and the output sums stay in registers, and the blocks are asked for
   two ahead (the K pass runs on into the first V blocks). */
static void attend_d64(const float* qh, int64_t group, const float* kh, const float* vh,
                       const int64_t* table, int64_t len, float scale, float* scores,
                       int64_t max_len, float* out) {
    const int64_t num_used = (len + D64_BLOCK - 1) / D64_BLOCK;
    __m512 qv[D64_MAX_GROUP][4];
    for (int64_t j = 0; j < group; j++)
        for (int i = 0; i < 4; i++) qv[j][i] = _mm512_loadu_ps(qh + j * 64 + i * 16);
    /* block i of the K pass, then block i - num_used of the V pass */
    #define D64_AHEAD(i) ((i) < num_used ? kh + table[(i)] * D64_BLOCK_FLOATS \
                                         : vh + table[(i) - num_used] * D64_BLOCK_FLOATS)
    prefetch_block(D64_AHEAD(0), D64_BLOCK_FLOATS);
    if (1 < 2 * num_used) prefetch_block(D64_AHEAD(1), D64_BLOCK_FLOATS);
    for (int64_t b = 0, t = 0; t < len; b++) {
        const float* kb = kh + table[b] * D64_BLOCK_FLOATS;
        if (b + 2 < 2 * num_used) prefetch_block(D64_AHEAD(b + 2), D64_BLOCK_FLOATS);
        const int64_t n = len - t < D64_BLOCK ? len - t : D64_BLOCK;
        for (int64_t o = 0; o < n; o++, t++) {
            const float* kt = kb + o * 64;
            const __m512 k0 = _mm512_loadu_ps(kt), k1 = _mm512_loadu_ps(kt + 16);
            const __m512 k2 = _mm512_loadu_ps(kt + 32), k3 = _mm512_loadu_ps(kt + 48);
            for (int64_t j = 0; j < group; j++) {
                __m512 d = _mm512_mul_ps(qv[j][0], k0);
                d = _mm512_fmadd_ps(qv[j][1], k1, d);
                d = _mm512_fmadd_ps(qv[j][2], k2, d);
                d = _mm512_fmadd_ps(qv[j][3], k3, d);
                scores[j * max_len + t] = _mm512_reduce_add_ps(d) * scale;
            }
        }
    }
    softmax_rows(scores, group, len, max_len);
    __m512 acc[D64_MAX_GROUP][4];
    for (int64_t j = 0; j < group; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
    for (int64_t b = 0, t = 0; t < len; b++) {
        const float* vb = vh + table[b] * D64_BLOCK_FLOATS;
        if (num_used + b + 2 < 2 * num_used) prefetch_block(D64_AHEAD(num_used + b + 2), D64_BLOCK_FLOATS);
        const int64_t n = len - t < D64_BLOCK ? len - t : D64_BLOCK;
        for (int64_t o = 0; o < n; o++, t++) {
            const float* vt = vb + o * 64;
            const __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16);
            const __m512 v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
            for (int64_t j = 0; j < group; j++) {
                const __m512 p = _mm512_set1_ps(scores[j * max_len + t]);
                acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
                acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
                acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
            }
        }
    }
    #undef D64_AHEAD
    for (int64_t j = 0; j < group; j++)
        for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + j * 64 + i * 16, acc[j][i]);
}
#endif

void paged_decode_attention_f32(
    const float* q, int64_t q_row_stride,          /* q[r, head, :] at q + r*stride + head*d */
    const float* k_cache, const float* v_cache,    /* [num_kv, num_blocks, block_size, d] */
    const int64_t* block_table, int64_t table_stride,
    const int32_t* lens,                           /* context tokens of each request */
    float* out, int64_t out_row_stride,            /* out[r, head*d + i] */
    int64_t num_reqs, int64_t num_heads, int64_t num_kv, int64_t head_dim,
    int64_t num_blocks, int64_t block_size, float scale, int64_t max_len, int num_threads)
{
    const int64_t group = num_heads / num_kv;
    const int64_t head_stride = num_blocks * block_size * head_dim;
    #pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * group * max_len);
        float* acc = (float*)malloc(sizeof(float) * group * head_dim);
        #pragma omp for collapse(2) schedule(dynamic, 4)
        for (int64_t r = 0; r < num_reqs; r++) {
            for (int64_t h = 0; h < num_kv; h++) {
                const int64_t len = lens[r];
                const int64_t* table = block_table + r * table_stride;
                const float* qh = q + r * q_row_stride + h * group * head_dim;
                const float* kh = k_cache + h * head_stride;
                const float* vh = v_cache + h * head_stride;
#if defined(__AVX512F__)
                if (head_dim == 64 && group <= D64_MAX_GROUP && block_size == D64_BLOCK) {
                    attend_d64(qh, group, kh, vh, table, len, scale, scores, max_len,
                               out + r * out_row_stride + h * group * head_dim);
                    continue;
                }
#endif
                const int64_t num_used = (len + block_size - 1) / block_size;
                const int64_t block_floats = block_size * head_dim;
                prefetch_block(kh + table[0] * block_floats, block_floats);
                for (int64_t b = 0, t = 0; t < len; b++) {
                    const float* kb = kh + table[b] * block_floats;
                    if (b + 1 < num_used) prefetch_block(kh + table[b + 1] * block_floats, block_floats);
                    else prefetch_block(vh + table[0] * block_floats, block_floats);
                    const int64_t n = len - t < block_size ? len - t : block_size;
                    for (int64_t o = 0; o < n; o++, t++)
                        for (int64_t j = 0; j < group; j++)
                            scores[j * max_len + t] =
                                dot(qh + j * head_dim, kb + o * head_dim, head_dim) * scale;
                }
                softmax_rows(scores, group, len, max_len);
                memset(acc, 0, sizeof(float) * group * head_dim);
                for (int64_t b = 0, t = 0; t < len; b++) {
                    const float* vb = vh + table[b] * block_floats;
                    if (b + 1 < num_used) prefetch_block(vh + table[b + 1] * block_floats, block_floats);
                    const int64_t n = len - t < block_size ? len - t : block_size;
                    for (int64_t o = 0; o < n; o++, t++) {
                        const float* vt = vb + o * head_dim;
                        for (int64_t j = 0; j < group; j++) {
                            const float p = scores[j * max_len + t];
                            float* a = acc + j * head_dim;
                            for (int64_t i = 0; i < head_dim; i++) a[i] += p * vt[i];
                        }
                    }
                }
                for (int64_t j = 0; j < group; j++)
                    memcpy(out + r * out_row_stride + (h * group + j) * head_dim,
                           acc + j * head_dim, sizeof(float) * head_dim);
            }
        }
        free(scores);
        free(acc);
    }
}

/* ---- Linear layers over GGUF blocks -------------------------------------------------------

   Weight layout (made once at load by quantized.py): the output rows go in tiles of TILE_N; a
   tile stores, for each block of 32 inputs, the TILE_N rows' blocks side by side, so that one
   thread's tiles are one sequential stream of memory:

       tiles[N / TILE_N][K / 32][TILE_N] of
         Q4 (Q4_0, Q4_1): struct { float d, m; uint8_t qs[16]; }   24 bytes
                          w[i] = d * q[i] + m, q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4
                          (Q4_0 is d * (q - 8): m = -8 d)
         Q8_0:            struct { float d, m; int8_t qs[32]; }    40 bytes, m = 0, w[i] = d * qs[i]

   Then y[r, n] = sum_b d_nb * (q_nb . x_rb) + m_nb * sum(x_rb): the block sums of x are made
   once per call. N is padded to a whole tile (zero rows, never written out). */

#define TILE_N 4
#define ROWS_AT_ONCE 2
#define GEMV_MAX_ROWS 8  /* beyond this many rows, expand the tile once (gguf_linear_f32) */

typedef struct { float d, m; uint8_t qs[16]; } block_q4;
typedef struct { float d, m; int8_t qs[32]; } block_q8;

enum { KIND_Q4 = 0, KIND_Q8 = 1 };

#if defined(__AVX512F__)
static inline void expand_q4(const block_q4* b, __m512* lo, __m512* hi) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)b->qs);
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m512 d = _mm512_set1_ps(b->d);
    *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask))));
    *hi = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask))));
}

static inline void expand_q8(const block_q8* b, __m512* lo, __m512* hi) {
    const __m512 d = _mm512_set1_ps(b->d);
    *lo = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b->qs))));
    *hi = _mm512_mul_ps(
        d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b->qs + 16)))));
}

/* One tile (TILE_N outputs) for ROWS_AT_ONCE rows of x or fewer. */
static void tile_rows(const char* tile, int kind, int64_t nb, const float* x, int64_t K,
                      const float* xsum, int64_t rows, float out[TILE_N][ROWS_AT_ONCE]) {
    const int64_t bsize = kind == KIND_Q4 ? sizeof(block_q4) : sizeof(block_q8);
    __m512 acc[TILE_N][ROWS_AT_ONCE][2];
    float macc[TILE_N][ROWS_AT_ONCE];
    for (int j = 0; j < TILE_N; j++)
        for (int r = 0; r < ROWS_AT_ONCE; r++) {
            acc[j][r][0] = acc[j][r][1] = _mm512_setzero_ps();
            macc[j][r] = 0.f;
        }
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        _mm_prefetch(blocks + 8 * TILE_N * bsize, _MM_HINT_T0);
        _mm_prefetch(blocks + 8 * TILE_N * bsize + 64, _MM_HINT_T0);
        __m512 xv[ROWS_AT_ONCE][2];
        for (int64_t r = 0; r < rows; r++) {
            xv[r][0] = _mm512_loadu_ps(x + r * K + b * 32);
            xv[r][1] = _mm512_loadu_ps(x + r * K + b * 32 + 16);
        }
        for (int j = 0; j < TILE_N; j++) {
            __m512 lo, hi;
            float m;
            if (kind == KIND_Q4) {
                const block_q4* blk = (const block_q4*)blocks + j;
                expand_q4(blk, &lo, &hi);
                m = blk->m;
            } else {
                const block_q8* blk = (const block_q8*)blocks + j;
                expand_q8(blk, &lo, &hi);
                m = blk->m;
            }
            for (int64_t r = 0; r < rows; r++) {
                acc[j][r][0] = _mm512_fmadd_ps(lo, xv[r][0], acc[j][r][0]);
                acc[j][r][1] = _mm512_fmadd_ps(hi, xv[r][1], acc[j][r][1]);
                macc[j][r] += m * xsum[r * nb + b];
            }
        }
    }
    for (int j = 0; j < TILE_N; j++)
        for (int64_t r = 0; r < rows; r++)
            out[j][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[j][r][0], acc[j][r][1])) + macc[j][r];
}
#else
static void tile_rows(const char* tile, int kind, int64_t nb, const float* x, int64_t K,
                      const float* xsum, int64_t rows, float out[TILE_N][ROWS_AT_ONCE]) {
    const int64_t bsize = kind == KIND_Q4 ? sizeof(block_q4) : sizeof(block_q8);
    for (int j = 0; j < TILE_N; j++)
        for (int64_t r = 0; r < rows; r++) out[j][r] = 0.f;
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int j = 0; j < TILE_N; j++) {
            float w[32], d, m;
            if (kind == KIND_Q4) {
                const block_q4* blk = (const block_q4*)blocks + j;
                for (int i = 0; i < 16; i++) {
                    w[i] = (float)(blk->qs[i] & 15);
                    w[i + 16] = (float)(blk->qs[i] >> 4);
                }
                d = blk->d, m = blk->m;
            } else {
                const block_q8* blk = (const block_q8*)blocks + j;
                for (int i = 0; i < 32; i++) w[i] = (float)blk->qs[i];
                d = blk->d, m = blk->m;
            }
            for (int64_t r = 0; r < rows; r++) {
                const float* xb = x + r * K + b * 32;
                float s = 0.f;
                for (int i = 0; i < 32; i++) s += w[i] * xb[i];
                out[j][r] += d * s + m * xsum[r * nb + b];
            }
        }
    }
}
#endif

#if defined(__AVX512F__)
/* A tile's TILE_N rows of W as float32, w[j * K + k], the minimum folded in (w = d q + m). */
static void expand_tile(const char* tile, int kind, int64_t nb, int64_t K, float* w) {
    const int64_t bsize = kind == KIND_Q4 ? sizeof(block_q4) : sizeof(block_q8);
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int j = 0; j < TILE_N; j++) {
            __m512 lo, hi, m;
            if (kind == KIND_Q4) {
                const block_q4* blk = (const block_q4*)blocks + j;
                expand_q4(blk, &lo, &hi);
                m = _mm512_set1_ps(blk->m);
            } else {
                const block_q8* blk = (const block_q8*)blocks + j;
                expand_q8(blk, &lo, &hi);
                m = _mm512_set1_ps(blk->m);
            }
            _mm512_storeu_ps(w + j * K + b * 32, _mm512_add_ps(lo, m));
            _mm512_storeu_ps(w + j * K + b * 32 + 16, _mm512_add_ps(hi, m));
        }
    }
}

/* The 16 lane sums of v[0..15] as one vector (lane i = the sum of v[i]), by a transposing
   add tree: 45 operations where 16 separate reductions take about 140. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [v2i_01, v2i+1_01, v2i_23, v2i+1_23] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: that lane's sums of v4i .. v4i+3 */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)  /* 128-bit lanes 0+1 and 2+3, of b2i then of b2i+1 */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                         _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

/* y[r, n0 + j] for the M rows of x against one expanded tile (rows are read in whole groups
   of GEMM_ROWS: past M the caller pads), 4 rows x 4 outputs at a time, 16 accumulators. */
#define GEMM_ROWS 4
static void tile_gemm(const float* w, const float* x, int64_t x_stride, int64_t M, int64_t K,
                      float* y, int64_t y_stride, int64_t n0, int64_t valid) {
    for (int64_t r0 = 0; r0 < M; r0 += GEMM_ROWS) {
        __m512 acc[GEMM_ROWS * TILE_N];
        for (int i = 0; i < GEMM_ROWS * TILE_N; i++) acc[i] = _mm512_setzero_ps();
        const float* xr = x + r0 * x_stride;
        for (int64_t k = 0; k < K; k += 16) {
            __m512 xv[GEMM_ROWS];
            for (int r = 0; r < GEMM_ROWS; r++) xv[r] = _mm512_loadu_ps(xr + r * x_stride + k);
            for (int j = 0; j < TILE_N; j++) {
                const __m512 wv = _mm512_loadu_ps(w + j * K + k);
                for (int r = 0; r < GEMM_ROWS; r++)
                    acc[r * TILE_N + j] = _mm512_fmadd_ps(xv[r], wv, acc[r * TILE_N + j]);
            }
        }
        float sums[GEMM_ROWS * TILE_N];
        _mm512_storeu_ps(sums, sum16(acc));
        const int64_t rows = M - r0 < GEMM_ROWS ? M - r0 : GEMM_ROWS;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < valid; j++) y[(r0 + r) * y_stride + n0 + j] = sums[r * TILE_N + j];
    }
}
#endif

void gguf_linear_f32(
    const float* x, int64_t x_row_stride, int64_t M, int64_t K,   /* x[M, K], rows may be strided */
    const void* tiles, int kind, int64_t N,                        /* W[N, K] as above */
    float* y, int64_t y_row_stride, int num_threads)               /* y[M, N] */
{
    const int64_t nb = K / 32;
    const int64_t ntiles = (N + TILE_N - 1) / TILE_N;
    const int64_t bsize = kind == KIND_Q4 ? sizeof(block_q4) : sizeof(block_q8);
    const int64_t tile_bytes = nb * TILE_N * bsize;
#if defined(__AVX512F__)
    if (M > GEMV_MAX_ROWS) {
        /* Many rows: expand each tile once into float32 (L1-sized) and multiply all rows by
           it; x is read in place, but for a last partial group of rows, copied zero-padded. */
        const int64_t full = M / GEMM_ROWS * GEMM_ROWS;
        float* tail = (float*)calloc(GEMM_ROWS * K, sizeof(float));
        for (int64_t r = full; r < M; r++)
            memcpy(tail + (r - full) * K, x + r * x_row_stride, sizeof(float) * K);
        #pragma omp parallel num_threads(num_threads)
        {
            float* w = (float*)malloc(sizeof(float) * TILE_N * K);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < ntiles; t++) {
                expand_tile((const char*)tiles + t * tile_bytes, kind, nb, K, w);
                const int64_t n0 = t * TILE_N, valid = N - n0 < TILE_N ? N - n0 : TILE_N;
                tile_gemm(w, x, x_row_stride, full, K, y, y_row_stride, n0, valid);
                if (full < M)
                    tile_gemm(w, tail, K, M - full, K, y + full * y_row_stride, y_row_stride, n0,
                              valid);
            }
            free(w);
        }
        free(tail);
        return;
    }
#endif
    float* xsum = (float*)malloc(sizeof(float) * M * nb);
    float* xc = (float*)malloc(sizeof(float) * M * K);
    for (int64_t r = 0; r < M; r++) {
        memcpy(xc + r * K, x + r * x_row_stride, sizeof(float) * K);
        for (int64_t b = 0; b < nb; b++) {
            float s = 0.f;
            for (int i = 0; i < 32; i++) s += xc[r * K + b * 32 + i];
            xsum[r * nb + b] = s;
        }
    }
    /* Few rows: expand each block in registers for ROWS_AT_ONCE rows at a time. */
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < ntiles; t++) {
        const char* tile = (const char*)tiles + t * tile_bytes;
        for (int64_t r0 = 0; r0 < M; r0 += ROWS_AT_ONCE) {
            const int64_t rows = M - r0 < ROWS_AT_ONCE ? M - r0 : ROWS_AT_ONCE;
            float out[TILE_N][ROWS_AT_ONCE];
            tile_rows(tile, kind, nb, xc + r0 * K, K, xsum + r0 * nb, rows, out);
            for (int j = 0; j < TILE_N && t * TILE_N + j < N; j++)
                for (int64_t r = 0; r < rows; r++) y[(r0 + r) * y_row_stride + t * TILE_N + j] = out[j][r];
        }
    }
    free(xsum);
    free(xc);
}

/* ---- The small per-layer operations -------------------------------------------------------

   Each is a handful of PyTorch ops (RMSNorm alone is five), and at decode sizes every op costs
   more in dispatch than in arithmetic. One call each here; rows in parallel only when there
   are enough of them to pay for waking the other threads. */

#define PARALLEL_MIN_FLOATS 32768

static inline float rms_scale(const float* x, int64_t n, float eps) {
    float s = 0.f;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; i++) s += x[i] * x[i];
    return 1.f / sqrtf(s / (float)n + eps);
}

/* out = x / rms(x) * w, row by row. */
void rms_norm_f32(const float* x, int64_t x_stride, int64_t rows, int64_t n, const float* w,
                  float eps, float* out, int64_t out_stride, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* xr = x + r * x_stride;
        float* o = out + r * out_stride;
        const float s = rms_scale(xr, n, eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * s);
    }
}

/* residual += y, then out = rms_norm(residual) * w: the residual stream between sublayers. */
void add_rms_norm_f32(float* residual, const float* y, int64_t rows, int64_t n, const float* w,
                      float eps, float* out, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        float* xr = residual + r * n;
        const float* yr = y + r * n;
        float* o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) xr[i] += yr[i];
        const float s = rms_scale(xr, n, eps);
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xr[i] * s);
    }
}

/* Neox-style rotary embedding in place: x[r, h, :] of `heads` heads of size d at
   x + r * row_stride + h * d; cos/sin are [rows, d], the rows' positions already looked up. */
void rope_f32(float* x, int64_t row_stride, int64_t rows, int64_t heads, int64_t d,
              const float* cos, const float* sin, int num_threads) {
    const int64_t half = d / 2;
    #pragma omp parallel for num_threads(num_threads) if (rows * heads * d >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* c = cos + r * d;
        const float* s = sin + r * d;
        for (int64_t h = 0; h < heads; h++) {
            float* a = x + r * row_stride + h * d;
            float* b = a + half;
            #pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = a[i], x2 = b[i];
                a[i] = x1 * c[i] - x2 * s[i];
                b[i] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* out[r, :] = silu(gate) * up, with gate_up[r] = [gate | up], each n wide. */
void silu_and_mul_f32(const float* gate_up, int64_t rows, int64_t n, float* out,
                      int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (rows * n >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++) {
        const float* g = gate_up + r * 2 * n;
        const float* u = g + n;
        float* o = out + r * n;
        #pragma omp simd
        for (int64_t i = 0; i < n; i++) {
            const float e = exp_nonpositive(-fabsf(g[i]));   /* exp(-|g|), never overflows */
            const float sig = g[i] >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
            o[i] = g[i] * sig * u[i];
        }
    }
}

/* The new tokens' K and V into the paged cache: caches [num_kv, slots, d], row t of k/v
   (num_kv heads of size d, rows `row_stride` apart) to slot slots[t]. */
void write_kv_f32(const float* k, const float* v, int64_t row_stride, int64_t rows,
                  int64_t num_kv, int64_t d, const int64_t* slots, float* k_cache,
                  float* v_cache, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++)
        for (int64_t h = 0; h < num_kv; h++) {
            const int64_t dst = (h * num_slots + slots[t]) * d;
            memcpy(k_cache + dst, k + t * row_stride + h * d, sizeof(float) * d);
            memcpy(v_cache + dst, v + t * row_stride + h * d, sizeof(float) * d);
        }
}
