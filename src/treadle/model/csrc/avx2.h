/* treadle's CPU kernels at the AVX2 level (x86-64-v3: AVX2, FMA, F16C; and the avx2vnni level,
   the same with AVX-VNNI, e.g. Intel's cores from Alder Lake on): 8-wide registers, 16
   of them. Included by cpu_kernels.c; it provides the KV rows' loads and stores, attend_d64,
   expand_tile, tile_gemm and few_rows_n, with the register tiles sized for 16 registers
   instead of AVX-512's 32. */
#include <immintrin.h>

#if defined(__AVXVNNI__)
#define TREADLE_ISA "avx2vnni"  /* the same, and AVX-VNNI's 256-bit vpdpbusd for int8*.h */
#else
#define TREADLE_ISA "avx2"
#endif
#define half_to_float(h) _cvtsh_ss(h)
#define HAVE_ATTEND_D64 1
#define D64_BLOCK 16                 /* tokens per cache block this path expects */
#define D64_MAX_GROUP 4

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The 8 lane sums of v[0..7] as one vector (lane i = the sum of v[i]): a transposing add
   tree of 9 operations where 8 separate reductions take about 40. */
static inline __m256 sum8(const __m256 v[8]) {
    /* hadd(a, b) = [a01 a23 b01 b23 | a45 a67 b45 b67] */
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* h0 = [v0 v1 v2 v3 summed over lanes 0-3 | the same over lanes 4-7], h1 for v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* 8 values of a KV cache row (common.h's types), from value i, as float32: a widening load. */
static inline __attribute__((always_inline)) __m256 kv_load8(const char* row, const int kvt,
                                                             int64_t i) {
    if (kvt == KV_F32) return _mm256_loadu_ps((const float*)row + i);
    if (kvt == KV_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + i)));
    if (kvt == KV_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)((const uint16_t*)row + i))), 16));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + i))));
}

/* A cache row as float32 (the generic attention loop's per-row conversion, into L1). */
static inline void kv_row_to_f32(const char* row, int kvt, int64_t d, float* out) {
    int64_t i = 0;
    if (kvt == KV_F32) { memcpy(out, row, sizeof(float) * d); return; }
    for (; i + 8 <= d; i += 8) {
        const __m256 v = kvt == KV_F16 ? kv_load8(row, KV_F16, i)
                       : kvt == KV_BF16 ? kv_load8(row, KV_BF16, i) : kv_load8(row, KV_I8, i);
        _mm256_storeu_ps(out + i, v);
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
    for (; i + 8 <= d; i += 8)
        _mm_storeu_si128((__m128i*)((uint16_t*)dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < d; i++) ((uint16_t*)dst)[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

/* One task for head size 64 and up to 4 query heads per KV head: the rows of `R` (common.h:
   one request's rows over one span of its context) attend one KV head's blocks in `table`.
   The K pass keeps a token's key in 8 registers, once for every row, and reads the query
   heads from L1; the dot products of 8 tokens are reduced together (sum8). The V pass
   accumulates one head at a time in 8 registers over a block that stays in L1, row by row.
   Blocks are asked for two ahead, as at AVX-512. Each cache row is widened to float32 as it
   is loaded (kv_load8); an int8 row's scale multiplies its score (K) or its probability (V).
   `kvt` is a constant where inlined. Row i's scores are at scores + i * group * stride. */
static inline __attribute__((always_inline)) void attend_d64_t(
    const attend_rows* R, int64_t group, const char* kh, const char* vh, const int64_t* table,
    float scale, float* scores, int64_t stride, const int kvt) {
    const int64_t len = R->n[R->count - 1];
    const int64_t num_used = (len + D64_BLOCK - 1) / D64_BLOCK;
    const int64_t rb = kv_row_bytes(kvt, 64), bb = D64_BLOCK * rb;
    #define D64_AHEAD(i) ((i) < num_used ? kh + table[(i)] * bb : vh + table[(i) - num_used] * bb)
    prefetch_bytes(D64_AHEAD(0), bb);
    if (1 < 2 * num_used) prefetch_bytes(D64_AHEAD(1), bb);
    __m256 part[ATTN_ROWS * D64_MAX_GROUP][8];  /* row r's head j: part[r * group + j] */
    float kscale[8] = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};  /* int8: the 8 rows' scales */
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t b = 0, t = 0; t < len; b++) {
        const char* kb = kh + table[b] * bb;
        if (b + 2 < 2 * num_used) prefetch_bytes(D64_AHEAD(b + 2), bb);
        const int64_t n = len - t < D64_BLOCK ? len - t : D64_BLOCK;
        for (int64_t o = 0; o < n; o++, t++) {
            const char* kt = kb + o * rb;
            __m256 k[8];
            for (int i = 0; i < 8; i++) k[i] = kv_load8(kt, kvt, 8 * i);
            if (kvt == KV_I8) kscale[t & 7] = kv_row_scale(kt, KV_I8, 64);
            for (int64_t r = R->count - 1; r >= 0 && t < R->n[r]; r--) {  /* the rows reaching t */
                const float* qh = R->q + r * R->q_stride;
                for (int64_t j = 0; j < group; j++) {
                    const float* qj = qh + j * 64;
                    __m256 d = _mm256_mul_ps(k[0], _mm256_loadu_ps(qj));
                    for (int i = 1; i < 8; i++)
                        d = _mm256_fmadd_ps(k[i], _mm256_loadu_ps(qj + 8 * i), d);
                    part[r * group + j][t & 7] = d;
                }
                if ((t & 7) != 7 && t != R->n[r] - 1) continue;
                const int64_t t0 = t & ~(int64_t)7, filled = t - t0 + 1;
                const __m256 rows_scale = kvt == KV_I8
                    ? _mm256_mul_ps(vscale, _mm256_loadu_ps(kscale)) : vscale;
                for (int64_t j = 0; j < group; j++) {
                    __m256* pj = part[r * group + j];
                    for (int64_t i = filled; i < 8; i++) pj[i] = _mm256_setzero_ps();
                    const __m256 s = _mm256_mul_ps(sum8(pj), rows_scale);
                    float* dst = scores + (r * group + j) * stride + t0;
                    if (filled == 8) _mm256_storeu_ps(dst, s);
                    else {
                        float tmp[8];
                        _mm256_storeu_ps(tmp, s);
                        memcpy(dst, tmp, sizeof(float) * filled);
                    }
                }
            }
        }
    }
    for (int64_t r = 0; r < R->count; r++)  /* a part (ml): not normalized */
        softmax_rows(scores + r * group * stride, group, R->n[r], stride, R->ml[r]);
    for (int64_t r = 0; r < R->count; r++) memset(R->out[r], 0, sizeof(float) * group * 64);
    for (int64_t b = 0, t = 0; t < len; b++) {
        const char* vb = vh + table[b] * bb;
        if (num_used + b + 2 < 2 * num_used) prefetch_bytes(D64_AHEAD(num_used + b + 2), bb);
        const int64_t n = len - t < D64_BLOCK ? len - t : D64_BLOCK;
        float vs[D64_BLOCK];  /* int8: the block's rows' scales */
        if (kvt == KV_I8)
            for (int64_t o = 0; o < n; o++) vs[o] = kv_row_scale(vb + o * rb, KV_I8, 64);
        for (int64_t r = R->count - 1; r >= 0 && t < R->n[r]; r--) {
            const int64_t nr = R->n[r] - t < n ? R->n[r] - t : n;
            for (int64_t j = 0; j < group; j++) {
                float* oj = R->out[r] + j * 64;
                const float* sj = scores + (r * group + j) * stride + t;
                __m256 a[8];
                for (int i = 0; i < 8; i++) a[i] = _mm256_loadu_ps(oj + 8 * i);
                for (int64_t o = 0; o < nr; o++) {
                    const __m256 p = _mm256_set1_ps(kvt == KV_I8 ? sj[o] * vs[o] : sj[o]);
                    const char* vt = vb + o * rb;
                    for (int i = 0; i < 8; i++)
                        a[i] = _mm256_fmadd_ps(p, kv_load8(vt, kvt, 8 * i), a[i]);
                }
                for (int i = 0; i < 8; i++) _mm256_storeu_ps(oj + 8 * i, a[i]);
            }
        }
        t += n;
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

/* A block's 32 quants as float32 in 4 registers, in order (d and m not applied). Q4: bytes
   0-7 and 8-15 widened to 32-bit lanes as they are loaded; the low nibbles are weights 0-15,
   the high ones 16-31. */
static inline void quants_q4(const block_q4* b, __m256 w[4]) {
    const __m256i t0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)b->qs));
    const __m256i t1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(b->qs + 8)));
    const __m256i low = _mm256_set1_epi32(15);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(t0, low));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(t1, low));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(t0, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(t1, 4));
}

static inline void quants_q8(const block_q8* b, __m256 w[4]) {
    for (int i = 0; i < 4; i++)
        w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(b->qs + 8 * i))));
}

static inline void block_quants(const char* blocks, int kind, int j, __m256 w[4]) {
    if (kind == KIND_Q4) quants_q4((const block_q4*)blocks + j, w);
    else quants_q8((const block_q8*)blocks + j, w);
}

/* A block of a tile's output j as 32 float32 weights in 4 registers, w = d q + m: one FMA per
   register (Q8: a multiply, w = d q), the weights of every path on the blocks. */
static inline __attribute__((always_inline)) void block_weights(const char* blocks, int kind,
                                                                int j, __m256 w[4]) {
    __m256 q[4];
    block_quants(blocks, kind, j, q);
    const __m128 dm = block_dm(blocks, kind, j);
    const __m256 dv = _mm256_broadcastss_ps(dm);
    if (kind == KIND_Q8) {  /* d q, as d q + 0 */
        for (int i = 0; i < 4; i++) w[i] = _mm256_mul_ps(q[i], dv);
        return;
    }
    const __m256 mv = _mm256_broadcastss_ps(_mm_shuffle_ps(dm, dm, 1));
    for (int i = 0; i < 4; i++) w[i] = _mm256_fmadd_ps(q[i], dv, mv);
}

/* A tile's TILE_N rows of W as float32, w[j * K + k], the minimum folded in (w = d q + m). */
static void expand_tile(const char* tile, int kind, int64_t nb, int64_t K, float* w) {
    const int64_t bsize = block_bytes(kind);
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int j = 0; j < TILE_N; j++) {
            __m256 v[4];
            block_weights(blocks, kind, j, v);
            for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + j * K + b * 32 + 8 * i, v[i]);
        }
    }
}

/* x . w for each (row, output) is one float32 chain of FMAs over k, 8 inputs each, then sum8's
   tree (the same order for every vector): tile_gemm and few_rows_n both make exactly this
   sum. */

/* y[r, n0 + j] for the M rows of x against one expanded tile (rows are read in whole groups
   of GEMM_ROWS: past M the caller pads), 3 rows x 4 outputs at a time: 12 accumulators, the
   3 rows of x and one weight vector fill the 16 registers. */
#define GEMM_ROWS 3
static void tile_gemm(const float* w, const float* x, int64_t x_stride, int64_t M, int64_t K,
                      float* y, int64_t y_stride, int64_t n0, int64_t valid) {
    for (int64_t r0 = 0; r0 < M; r0 += GEMM_ROWS) {
        __m256 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm256_setzero_ps();
        const float* xr = x + r0 * x_stride;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 xv[GEMM_ROWS];
            for (int r = 0; r < GEMM_ROWS; r++) xv[r] = _mm256_loadu_ps(xr + r * x_stride + k);
            for (int j = 0; j < TILE_N; j++) {
                const __m256 wv = _mm256_loadu_ps(w + j * K + k);
                for (int r = 0; r < GEMM_ROWS; r++)
                    acc[r * TILE_N + j] = _mm256_fmadd_ps(xv[r], wv, acc[r * TILE_N + j]);
            }
        }
        float sums[16];
        _mm256_storeu_ps(sums, sum8(acc));
        _mm256_storeu_ps(sums + 8, sum8(acc + 8));
        const int64_t rows = M - r0 < GEMM_ROWS ? M - r0 : GEMM_ROWS;
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < valid; j++) y[(r0 + r) * y_stride + n0 + j] = sums[r * TILE_N + j];
    }
}

/* ---- Few rows: each block expanded once in registers for up to FEW_ROWS rows --------------

   Each (row, output) is tile_gemm's sum (above), so a row's result is the same bits on either
   path and whatever rows share the call. 16 registers hold OUTS x ROWS accumulators (<= 8)
   and one block's weights (4), a pass's blocks expanded one output at a time: 1 and 2 rows
   take the whole tile per pass, 3 and 4 rows 2 outputs a pass, 5 to 8 rows one.

   The cost at one row: a Q4 block takes 4 FMAs to expand (w = d q + m) and 4 to multiply,
   where the old one-row path (d (q . x) + m sum(x), other bits than tile_gemm's) took 6 in
   all; two chains per sum (fewer stalls at one row) would cost tile_gemm half its register
   blocking. Measured (one thread, the default model's decode step, TREADLE_CPU_ISA=avx2 on
   a Zen 4): 1 row 1.15x the old path's time, 2-5 rows 0.82-0.87x, 9 rows 0.98x. */
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
    const int outs = rows <= 2 ? 4 : rows <= 4 ? 2 : 1;
    for (int j0 = 0; j0 < TILE_N; j0 += outs) {
        __m256 acc[8];
        for (int i = 0; i < 8; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t blk = 0; blk < nb; blk++) {
            const char* blocks = tile + blk * TILE_N * bsize;
            if (j0 == 0)  /* the first pass over the tile brings it into L1 for the others */
                for (int64_t off = 0; off < TILE_N * bsize; off += 64)
                    _mm_prefetch(blocks + 8 * TILE_N * bsize + off, _MM_HINT_T0);
            for (int jj = 0; jj < outs; jj++) {
                __m256 w[4];
                block_weights(blocks, kind, j0 + jj, w);
                for (int r = 0; r < rows; r++) {
                    const float* xr = x + r * x_stride + blk * 32;
                    const int i = r * outs + jj;
                    for (int q = 0; q < 4; q++)
                        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8 * q), w[q], acc[i]);
                }
            }
        }
        float sums[8];
        _mm256_storeu_ps(sums, sum8(acc));
        for (int r = 0; r < rows; r++)
            for (int jj = 0; jj < outs; jj++) out[r][j0 + jj] = sums[r * outs + jj];
    }
}

/* ---- One or two rows the sum way: d (q . x) + m sum(x) -------------------------------------

   A single stream's decode step is this level's most common call, and its sum way takes 6
   operations per Q4 block (4 to multiply q by x, one FMA by d, one by m with the block sum of
   x) against few_rows_n's 8 (4 to expand w = d q + m, 4 to multiply): few_rows_n's one-row step
   took 1.15x this one's time (TREADLE_CPU_ISA=avx2 on a Zen 4). So at this level 1 and 2 rows
   take it (`SUM_MAX_ROWS`), and a row's bits are the same in a 1- or 2-row call but differ
   (float rounding) from the same row in a call of 3 or more. `xs2` holds the pairs
   [0, block sum] per row and block (gguf_linear_f32 makes them once per call). */
#define SUM_MAX_ROWS 2

static inline __attribute__((always_inline)) void sum_two_outputs(
    const char* tile, const int kind, int64_t nb, int j0, const float* x, int64_t K,
    const float* xs2, const int rows, float out[TILE_N][SUM_MAX_ROWS]) {
    const int64_t bsize = block_bytes(kind);
    __m256 acc[2][SUM_MAX_ROWS];
    __m128 macc[2][SUM_MAX_ROWS];
    for (int jj = 0; jj < 2; jj++)
        for (int r = 0; r < rows; r++) {
            acc[jj][r] = _mm256_setzero_ps();
            macc[jj][r] = _mm_setzero_ps();
        }
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        if (j0 == 0)  /* the first pass over the tile brings it into L1 for the second */
            for (int64_t off = 0; off < TILE_N * bsize; off += 64)
                _mm_prefetch(blocks + 8 * TILE_N * bsize + off, _MM_HINT_T0);
        for (int jj = 0; jj < 2; jj++) {
            __m256 w[4];
            block_quants(blocks, kind, j0 + jj, w);
            const __m128 dm = block_dm(blocks, kind, j0 + jj);
            const __m256 d = _mm256_broadcastss_ps(dm);
            for (int r = 0; r < rows; r++) {
                const float* xr = x + r * K + b * 32;
                __m256 s = _mm256_mul_ps(w[0], _mm256_loadu_ps(xr));
                s = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + 8), s);
                s = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + 16), s);
                s = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + 24), s);
                acc[jj][r] = _mm256_fmadd_ps(d, s, acc[jj][r]);
                if (kind == KIND_Q4) {
                    const __m128 xs = _mm_castpd_ps(_mm_load_sd((const double*)(xs2 + 2 * (r * nb + b))));
                    macc[jj][r] = _mm_fmadd_ps(dm, xs, macc[jj][r]);
                }
            }
        }
    }
    for (int jj = 0; jj < 2; jj++)
        for (int r = 0; r < rows; r++)
            out[j0 + jj][r] = hsum8(acc[jj][r]) + _mm_cvtss_f32(_mm_shuffle_ps(macc[jj][r], macc[jj][r], 1));
}

static inline __attribute__((always_inline)) void sum_rows_n(
    const char* tile, const int kind, int64_t nb, const float* x, int64_t K, const float* xs2,
    const int rows, float out[TILE_N][SUM_MAX_ROWS]) {
    for (int j0 = 0; j0 < TILE_N; j0 += 2) sum_two_outputs(tile, kind, nb, j0, x, K, xs2, rows, out);
}

