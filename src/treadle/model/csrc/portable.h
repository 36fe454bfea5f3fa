/* treadle's CPU kernels for any CPU (no ISA flags: SSE2 on x86-64, NEON on arm64 as the
   compiler sees fit): plain C loops written for the auto-vectorizer. Included by cpu_kernels.c;
   it provides the KV rows' loads and stores, expand_tile and tile_gemm (attention
   takes the generic loop). */

#define TREADLE_ISA "portable"
#define half_to_float(h) half_to_float_c(h)
#define HAVE_ATTEND_D64 0

/* A cache row as float32 (common.h's types), for the generic attention loop. */
static inline void kv_row_to_f32(const char* row, int kvt, int64_t d, float* out) {
    if (kvt == KV_F32) memcpy(out, row, sizeof(float) * d);
    else if (kvt == KV_F16)
        for (int64_t i = 0; i < d; i++) out[i] = half_to_float_c(((const uint16_t*)row)[i]);
    else if (kvt == KV_BF16)
        for (int64_t i = 0; i < d; i++) out[i] = bf16_to_float(((const uint16_t*)row)[i]);
    else
        for (int64_t i = 0; i < d; i++) out[i] = (float)((const int8_t*)row)[i];
}

#define kv_store_row kv_store_row_c

/* A block's 32 weights as float32, w = d q + m. */
static inline void block_weights(const char* blocks, int kind, int j, float w[32]) {
    if (kind == KIND_Q4) {
        const block_q4* blk = (const block_q4*)blocks + j;
        const float d = BLOCK_D(blk), m = Q4_M(blk);
        for (int i = 0; i < 16; i++) {
            w[i] = d * (float)(blk->qs[i] & 15) + m;
            w[i + 16] = d * (float)(blk->qs[i] >> 4) + m;
        }
    } else {
        const block_q8* blk = (const block_q8*)blocks + j;
        const float d = BLOCK_D(blk);
        for (int i = 0; i < 32; i++) w[i] = d * (float)blk->qs[i];
    }
}

static void expand_tile(const char* tile, int kind, int64_t nb, int64_t K, float* w) {
    const int64_t bsize = block_bytes(kind);
    for (int64_t b = 0; b < nb; b++)
        for (int j = 0; j < TILE_N; j++)
            block_weights(tile + b * TILE_N * bsize, kind, j, w + j * K + b * 32);
}

/* x . w over K (a multiple of 32) in 8 lanes, k's order within each lane, then a fixed tree:
   the same bits for a row whatever its address or the rows beside it (`dot`'s vectorized
   order is the compiler's). */
static inline float dot_lanes(const float* x, const float* w, int64_t K) {
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int64_t k = 0; k < K; k += 8)
        for (int i = 0; i < 8; i++) acc[i] += x[k + i] * w[k + i];
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* Every row count takes the expanded tile (no register path: FEW_MAX_ROWS 0), so a row's
   result never depends on the rows beside it. */
#define GEMM_ROWS 1
#define FEW_ROWS 1
#define FEW_MAX_ROWS 0
static void tile_gemm(const float* w, const float* x, int64_t x_stride, int64_t M, int64_t K,
                      float* y, int64_t y_stride, int64_t n0, int64_t valid) {
    for (int64_t r = 0; r < M; r++)
        for (int64_t j = 0; j < valid; j++)
            y[r * y_stride + n0 + j] = dot_lanes(x + r * x_stride, w + j * K, K);
}
