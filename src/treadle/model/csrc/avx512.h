/* treadle's CPU kernels at the AVX-512 level (x86-64-v4: F, BW, DQ, VL): 16-wide registers.
   Included by cpu_kernels.c; it provides the KV rows' loads and stores, attend_d64,
   expand_tile, tile_gemm and few_rows_n. */
#include <immintrin.h>

#if defined(__AVX512VNNI__)
#define TREADLE_ISA "avx512vnni"  /* the same, and vpdpbusd for int8.h */
#else
#define TREADLE_ISA "avx512"
#endif
#define half_to_float(h) _cvtsh_ss(h)
#define HAVE_ATTEND_D64 1
#define D64_BLOCK 16                 /* tokens per cache block this path expects */
#define D64_MAX_GROUP 4

/* 16 values of a KV cache row (common.h's types), from value i, as float32: a widening load. */
static inline __attribute__((always_inline)) __m512 kv_load16(const char* row, const int kvt,
                                                              int64_t i) {
    if (kvt == KV_F32) return _mm512_loadu_ps((const float*)row + i);
    if (kvt == KV_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i)));
    if (kvt == KV_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)row + i))),
            16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + i))));
}

/* A cache row as float32 (the generic attention loop's per-row conversion, into L1). */
static inline void kv_row_to_f32(const char* row, int kvt, int64_t d, float* out) {
    int64_t i = 0;
    if (kvt == KV_F32) { memcpy(out, row, sizeof(float) * d); return; }
    for (; i + 16 <= d; i += 16) {
        const __m512 v = kvt == KV_F16 ? kv_load16(row, KV_F16, i)
                       : kvt == KV_BF16 ? kv_load16(row, KV_BF16, i) : kv_load16(row, KV_I8, i);
        _mm512_storeu_ps(out + i, v);
    }
    for (; i < d; i++)
        out[i] = kvt == KV_F16 ? _cvtsh_ss(((const uint16_t*)row)[i])
               : kvt == KV_BF16 ? bf16_to_float(((const uint16_t*)row)[i])
               : (float)((const int8_t*)row)[i];
}

/* One row into the cache: F16C's conversion (round to nearest even) for float16. */
static inline void kv_store_row(char* dst, const float* x, int kvt, int64_t d) {
    if (kvt != KV_F16) { kv_store_row_c(dst, x, kvt, d); return; }
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        _mm256_storeu_si256((__m256i*)((uint16_t*)dst + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) ((uint16_t*)dst)[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
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

/* One task for head size 64 and up to 4 query heads per KV head (the common shapes): the rows
   of `R` (common.h: one request's rows over one span of its context) attend one KV head's
   blocks in `table`. A row's query heads and output sums stay in registers, and the blocks are
   asked for two ahead (the K pass runs on into the first V blocks). The K pass loads each
   block once for every row (one request's speculative rows, or a prefill chunk's, read its K
   once); the V pass goes row by row over blocks that the first row brought into the caches.
   Each cache row is widened to float32 as it is loaded (kv_load16); an int8 row's scale
   multiplies its score (K) or its probability (V). `kvt` is a constant where this is inlined
   (attend_d64 below). Row i's scores are at scores + i * group * stride. */
static inline __attribute__((always_inline)) void attend_d64_t(
    const attend_rows* R, int64_t group, const char* kh, const char* vh, const int64_t* table,
    float scale, float* scores, int64_t stride, const int kvt) {
    const int64_t len = R->n[R->count - 1];
    const int64_t num_used = (len + D64_BLOCK - 1) / D64_BLOCK;
    const int64_t rb = kv_row_bytes(kvt, 64), bb = D64_BLOCK * rb;
    /* block i of the K pass, then block i - num_used of the V pass */
    #define D64_AHEAD(i) ((i) < num_used ? kh + table[(i)] * bb : vh + table[(i) - num_used] * bb)
    prefetch_bytes(D64_AHEAD(0), bb);
    if (1 < 2 * num_used) prefetch_bytes(D64_AHEAD(1), bb);
    /* The K pass a block (16 tokens) at a time: per query, each token's 16 lane products in
       a register, and one transposing add tree (sum16) makes the block's 16 scores, where a
       reduction per score costs about 3x the adds. A row's tokens past its length are zeros,
       and a lane's sum does not depend on the others, so a score's bits are the same in a
       whole block and in a partial one. Rows not float32 are widened once into `kf`. */
    float kf[D64_BLOCK * 64] __attribute__((aligned(64)));
    float rs[D64_BLOCK] __attribute__((aligned(64)));
    for (int64_t b = 0, t = 0; t < len; b++, t += D64_BLOCK) {
        const char* kb = kh + table[b] * bb;
        if (b + 2 < 2 * num_used) prefetch_bytes(D64_AHEAD(b + 2), bb);
        const int64_t n = len - t < D64_BLOCK ? len - t : D64_BLOCK;
        const float* k = (const float*)kb;
        if (kvt != KV_F32) {
            for (int64_t o = 0; o < n; o++)
                for (int i = 0; i < 4; i++)
                    _mm512_store_ps(kf + o * 64 + 16 * i, kv_load16(kb + o * rb, kvt, 16 * i));
            k = kf;
        }
        for (int64_t o = 0; o < D64_BLOCK; o++)
            rs[o] = o < n ? scale * kv_row_scale(kb + o * rb, kvt, 64) : 0.f;
        const __m512 row_scales = _mm512_load_ps(rs);
        for (int64_t r = 0; r < R->count; r++) {
            const int64_t nr = R->n[r] - t < D64_BLOCK ? R->n[r] - t : D64_BLOCK;
            if (nr <= 0) continue;
            const __mmask16 valid = (__mmask16)((1u << nr) - 1);
            const float* qh = R->q + r * R->q_stride;
            float* sr = scores + r * group * stride + t;
            for (int64_t j = 0; j < group; j++) {
                const __m512 q0 = _mm512_loadu_ps(qh + j * 64), q1 = _mm512_loadu_ps(qh + j * 64 + 16);
                const __m512 q2 = _mm512_loadu_ps(qh + j * 64 + 32);
                const __m512 q3 = _mm512_loadu_ps(qh + j * 64 + 48);
                __m512 d[D64_BLOCK];
                for (int64_t o = 0; o < D64_BLOCK; o++) {
                    if (o >= nr) { d[o] = _mm512_setzero_ps(); continue; }
                    const float* kt = k + o * 64;
                    d[o] = _mm512_mul_ps(q0, _mm512_loadu_ps(kt));
                    d[o] = _mm512_fmadd_ps(q1, _mm512_loadu_ps(kt + 16), d[o]);
                    d[o] = _mm512_fmadd_ps(q2, _mm512_loadu_ps(kt + 32), d[o]);
                    d[o] = _mm512_fmadd_ps(q3, _mm512_loadu_ps(kt + 48), d[o]);
                }
                _mm512_mask_storeu_ps(sr + j * stride, valid, _mm512_mul_ps(sum16(d), row_scales));
            }
        }
    }
    for (int64_t r = 0; r < R->count; r++)  /* a part (ml): not normalized */
        softmax_rows(scores + r * group * stride, group, R->n[r], stride, R->ml[r]);
    for (int64_t r = 0; r < R->count; r++) {
        const float* sr = scores + r * group * stride;
        __m512 acc[D64_MAX_GROUP][4];
        for (int64_t j = 0; j < group; j++)
            for (int i = 0; i < 4; i++) acc[j][i] = _mm512_setzero_ps();
        for (int64_t b = 0, t = 0; t < R->n[r]; b++) {
            const char* vb = vh + table[b] * bb;
            if (num_used + b + 2 < 2 * num_used) prefetch_bytes(D64_AHEAD(num_used + b + 2), bb);
            const int64_t n = R->n[r] - t < D64_BLOCK ? R->n[r] - t : D64_BLOCK;
            for (int64_t o = 0; o < n; o++, t++) {
                const char* vt = vb + o * rb;
                const __m512 v0 = kv_load16(vt, kvt, 0), v1 = kv_load16(vt, kvt, 16);
                const __m512 v2 = kv_load16(vt, kvt, 32), v3 = kv_load16(vt, kvt, 48);
                const float vs = kv_row_scale(vt, kvt, 64);
                for (int64_t j = 0; j < group; j++) {
                    const __m512 p = _mm512_set1_ps(kvt == KV_I8 ? sr[j * stride + t] * vs
                                                                 : sr[j * stride + t]);
                    acc[j][0] = _mm512_fmadd_ps(p, v0, acc[j][0]);
                    acc[j][1] = _mm512_fmadd_ps(p, v1, acc[j][1]);
                    acc[j][2] = _mm512_fmadd_ps(p, v2, acc[j][2]);
                    acc[j][3] = _mm512_fmadd_ps(p, v3, acc[j][3]);
                }
            }
        }
        for (int64_t j = 0; j < group; j++)
            for (int i = 0; i < 4; i++) _mm512_storeu_ps(R->out[r] + j * 64 + i * 16, acc[j][i]);
    }
    #undef D64_AHEAD
}

static void attend_d64(const attend_rows* R, int64_t group, const char* kh, const char* vh,
                       const int64_t* table, float scale, float* scores, int64_t stride,
                       int kvt) {
    switch (kvt) {
    case KV_F16: attend_d64_t(R, group, kh, vh, table, scale, scores, stride, KV_F16); break;
    case KV_BF16: attend_d64_t(R, group, kh, vh, table, scale, scores, stride, KV_BF16); break;
    case KV_I8: attend_d64_t(R, group, kh, vh, table, scale, scores, stride, KV_I8); break;
    default: attend_d64_t(R, group, kh, vh, table, scale, scores, stride, KV_F32);
    }
}

/* A block's 32 quants as float32 in 2 registers, in order (d and m not applied). */
static inline void quants_q4(const block_q4* b, __m512* lo, __m512* hi) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)b->qs));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}

static inline void quants_q8(const block_q8* b, __m512* lo, __m512* hi) {
    *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)b->qs)));
    *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(b->qs + 16))));
}

static inline void block_quants(const char* blocks, int kind, int j, __m512* lo, __m512* hi) {
    if (kind == KIND_Q4) quants_q4((const block_q4*)blocks + j, lo, hi);
    else quants_q8((const block_q8*)blocks + j, lo, hi);
}

/* A block of a tile's output j as 32 float32 weights in 2 registers, w = d q + m: one FMA per
   register (Q8: a multiply, w = d q), the weights of every path on the blocks. */
static inline __attribute__((always_inline)) void block_weights(const char* blocks, int kind,
                                                                int j, __m512 w[2]) {
    __m512 lo, hi;
    block_quants(blocks, kind, j, &lo, &hi);
    const __m128 dm = block_dm(blocks, kind, j);
    const __m512 d = _mm512_broadcastss_ps(dm);
    if (kind == KIND_Q8) {  /* d q, as d q + 0 */
        w[0] = _mm512_mul_ps(lo, d);
        w[1] = _mm512_mul_ps(hi, d);
        return;
    }
    const __m512 m = _mm512_broadcastss_ps(_mm_shuffle_ps(dm, dm, 1));
    w[0] = _mm512_fmadd_ps(lo, d, m);
    w[1] = _mm512_fmadd_ps(hi, d, m);
}

/* A tile's TILE_N rows of W as float32, w[j * K + k], the minimum folded in (w = d q + m). */
static void expand_tile(const char* tile, int kind, int64_t nb, int64_t K, float* w) {
    const int64_t bsize = block_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int j = 0; j < TILE_N; j++) {
            __m512 v[2];
            block_weights(blocks, kind, j, v);
            _mm512_storeu_ps(w + j * K + b * 32, v[0]);
            _mm512_storeu_ps(w + j * K + b * 32 + 16, v[1]);
        }
    }
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

/* ---- Few rows: each block expanded once in registers for up to FEW_ROWS rows --------------

   The rows of one pass share each block's expansion (block_weights), and each (row, output)
   is the very sum tile_gemm makes: one accumulator over k, 16 inputs per FMA in k's order
   (the block's low half, then its high half), then sum16's tree, which adds a vector's lanes
   in the same order wherever it sits among the 16. So a row's result does not depend on the
   path, nor on the rows beside it: the rows of any call are the bits of that row alone.

   Register budget (32): OUTS x ROWS accumulators (<= 16) and OUTS blocks' weights (2 each):
   up to 4 rows take the whole tile per pass, 5 to 8 take it in two passes of 2 outputs. */
#ifndef FEW_ROWS          /* (-D: benchmarks/linear_crossover.py --variant) */
#define FEW_ROWS 8         /* rows per pass over a tile, at most 8 */
#endif
#ifndef FEW_MAX_ROWS
#define FEW_MAX_ROWS 8     /* up to this many rows of a call; beyond, tile_gemm */
#endif

static inline __attribute__((always_inline)) void few_rows_n(
    const char* tile, const int kind, int64_t nb, const float* x, int64_t x_stride,
    const int rows, float out[FEW_ROWS][TILE_N]) {
    const int64_t bsize = block_bytes(kind);
    const int outs = rows <= 4 ? 4 : 2;
    for (int j0 = 0; j0 < TILE_N; j0 += outs) {
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const char* blocks = tile + b * TILE_N * bsize;
            if (j0 == 0)  /* the first pass over the tile brings it into L1 for the second */
                for (int64_t off = 0; off < TILE_N * bsize; off += 64)
                    _mm_prefetch(blocks + 8 * TILE_N * bsize + off, _MM_HINT_T0);
            __m512 w[4][2];
            for (int jj = 0; jj < outs; jj++) block_weights(blocks, kind, j0 + jj, w[jj]);
            for (int r = 0; r < rows; r++) {
                const float* xr = x + r * x_stride + b * 32;
                const __m512 x0 = _mm512_loadu_ps(xr), x1 = _mm512_loadu_ps(xr + 16);
                for (int jj = 0; jj < outs; jj++) {
                    acc[r * outs + jj] = _mm512_fmadd_ps(x0, w[jj][0], acc[r * outs + jj]);
                    acc[r * outs + jj] = _mm512_fmadd_ps(x1, w[jj][1], acc[r * outs + jj]);
                }
            }
        }
        float sums[16];
        _mm512_storeu_ps(sums, sum16(acc));
        for (int r = 0; r < rows; r++)
            for (int jj = 0; jj < outs; jj++) out[r][j0 + jj] = sums[r * outs + jj];
    }
}
