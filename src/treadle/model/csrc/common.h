/* What every ISA level of treadle's CPU kernels shares: the GGUF block layout, exp, prefetch,
   softmax and the scalar dot product. Included once, by cpu_kernels.c. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

/* Each of `rows` rows of `len` scores (`stride` apart) replaced by exp(s - m), m its max; with
   `ml`, each row's m and sum in ml[2 j], ml[2 j + 1] and no more (a part of a split context,
   paged_decode_attention_f32), else divided by the sum: the softmax. The max is taken in
   vector lanes (a max is exact in any order; where a +0 and a -0 tie, s - m and so exp(s - m)
   are the same either way), where one compare a score had made a chain of its latencies. */
static void softmax_rows(float* scores, int64_t rows, int64_t len, int64_t stride, float* ml) {
    for (int64_t j = 0; j < rows; j++) {
        float* s = scores + j * stride;
        float m = s[0];
        #pragma omp simd reduction(max:m)
        for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;
        float total = 0.f;
        #pragma omp simd reduction(+:total)
        for (int64_t t = 0; t < len; t++) {
            s[t] = exp_nonpositive(s[t] - m);
            total += s[t];
        }
        if (ml) {
            ml[2 * j] = m;
            ml[2 * j + 1] = total;
            continue;
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
}

/* The most rows one attention task takes at once (paged_decode_attention_f32). */
#define ATTN_ROWS 16

/* Rows of one request that one attention task attends over the same span of its context (the
   positions a speculative step verifies, a prefill chunk's tokens): their KV blocks are read
   once for all of them, each row's own length applied. Row i's query heads are at q + i *
   q_stride; it attends the span's first n[i] tokens (non-decreasing in i; the span is
   n[count - 1] long); its group x head_dim results go to out[i], normalized, or with ml[i]
   (a part of a split context) unnormalized and each head's (m, l) in ml[i]. Each row's
   results have the bits it gets alone: the same operations in the same order. */
typedef struct {
    int64_t count, q_stride;
    const float* q;
    int64_t n[ATTN_ROWS];
    float* out[ATTN_ROWS];
    float* ml[ATTN_ROWS];
} attend_rows;

/* ---- The KV cache's element types (`--kv-cache-dtype`) ------------------------------------

   A cache row is one token's K (or V) of one KV head, head_dim values. The attention kernel and
   the KV write take the type with the cache, and the readers convert each row in registers (a
   16-bit value is exactly a float32's upper or rounded half; int8 is q * the row's scale), so
   a decode step reads 2 or ~3.8 times fewer bytes than float32 and never expands the cache.

       KV_F32   float32[d]                     4 d bytes
       KV_F16   IEEE half[d]                   2 d bytes (round to nearest even on write)
       KV_BF16  bfloat16[d]                    2 d bytes (round to nearest even on write)
       KV_I8    int8 q[d], float32 scale       d + 4 bytes: x = q * scale, with scale =
                                               max|x| / 127 and q = rint(x * (127 / max|x|))

   int8 takes one scale per (token, head) row rather than llama.cpp's q8_0 blocks of 32: the
   scale then factors out of both products (score = scale_k (q . k), and V's is folded into the
   token's probability), so the inner loops are the float32 loops with a widening load; at
   head_dim 64 the row is 68 bytes where q8_0 takes 68 too. */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };

static inline int64_t kv_row_bytes(int kvt, int64_t d) {
    return kvt == KV_F32 ? 4 * d : kvt == KV_I8 ? d + 4 : 2 * d;
}

/* The int8 row's scale (1 for the other types: their values are the values). */
static inline float kv_row_scale(const char* row, int kvt, int64_t d) {
    if (kvt != KV_I8) return 1.f;
    float s;
    memcpy(&s, row + d, sizeof(s));
    return s;
}

static inline float bf16_to_float(uint16_t h) {
    union { uint32_t u; float f; } v = { (uint32_t)h << 16 };
    return v.f;
}

/* float -> bfloat16, round to nearest even (a NaN stays a quiet NaN), as PyTorch's. */
static inline uint16_t float_to_bf16(float f) {
    union { float f; uint32_t u; } v = { f };
    if ((v.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((v.u >> 16) | 0x40);
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

/* float -> IEEE half, round to nearest even (overflow to inf, subnormals kept), in plain C for
   the portable level (the AVX levels use F16C's instruction). */
static inline uint16_t float_to_half_c(float f) {
    union { float f; uint32_t u; } v = { f };
    const uint32_t sign = (v.u >> 16) & 0x8000u, a = v.u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u);                /* nan */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);               /* >= 65520: inf */
    if (a < 0x38800000u) {                                                 /* subnormal or 0 */
        if (a < 0x33000000u) return (uint16_t)sign;                        /* < 2^-25: 0 */
        const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
        const int shift = 126 - (int)(a >> 23);                            /* 14 .. 24 */
        uint32_t h = mant >> shift;
        const uint32_t rest = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rest > half || (rest == half && (h & 1u))) h++;
        return (uint16_t)(sign | h);
    }
    const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);                      /* nearest even */
    return (uint16_t)(sign | ((r - 0x38000000u) >> 13));
}

/* One row of x (d floats) into a cache row of type kvt: the plain-C part of every level (the
   levels' headers replace the float16 one with F16C). */
static inline void kv_store_row_c(char* dst, const float* x, int kvt, int64_t d) {
    if (kvt == KV_F32) {
        memcpy(dst, x, sizeof(float) * d);
    } else if (kvt == KV_BF16) {
        uint16_t* o = (uint16_t*)dst;
        for (int64_t i = 0; i < d; i++) o[i] = float_to_bf16(x[i]);
    } else if (kvt == KV_F16) {
        uint16_t* o = (uint16_t*)dst;
        for (int64_t i = 0; i < d; i++) o[i] = float_to_half_c(x[i]);
    } else {
        float amax = 0.f;
        for (int64_t i = 0; i < d; i++) amax = fmaxf(amax, fabsf(x[i]));
        const float inv = amax > 0.f ? 127.f / amax : 0.f, scale = amax / 127.f;
        int8_t* q = (int8_t*)dst;
        for (int64_t i = 0; i < d; i++) q[i] = (int8_t)rintf(x[i] * inv);
        memcpy(dst + d, &scale, sizeof(scale));
    }
}

/* Ask for `bytes` of a block ahead of use (as prefetch_block, counted in bytes). */
static inline void prefetch_bytes(const char* block, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(block + i, 0, 1);
}

/* ---- GGUF blocks in the kernel's layout ---------------------------------------------------

   Weight layout (made once at load by quantized.py): the output rows go in tiles of TILE_N; a
   tile stores, for each block of 32 inputs, the TILE_N rows' blocks side by side, so that one
   thread's tiles are one sequential stream of memory:

       tiles[N / TILE_N][K / 32][TILE_N] of
         Q4 (Q4_0, Q4_1): struct { half d, m; uint8_t qs[16]; }   20 bytes (GGUF's Q4_1)
                          w[i] = d * q[i] + m, q[i] = qs[i] & 15, q[i + 16] = qs[i] >> 4
                          (Q4_0 is d * (q - 8): m = -8 d, exact in half precision)
         Q8_0:            struct { half d; int8_t qs[32]; }        34 bytes (GGUF's Q8_0)
                          w[i] = d * qs[i]

   The scales stay IEEE half floats, as in the file: a decode step is bound by reading these
   bytes, and float32 scales would be a fifth more of them. Each level converts them its own
   way (F16C where it has it: `half_to_float`).

   Every path computes y[r, n] = x_r . w_n with the block's weights expanded to float32 first
   (w = d q + m, one FMA: `block_weights`) and one float32 sum per (row, output) in the order
   of k; the level's header fixes the lane width and the final tree. Few rows (up to the
   level's FEW_MAX_ROWS): each block expanded in registers and applied to FEW_ROWS rows at a
   time (`few_rows_n`). Many rows: each tile expanded once into float32 in L1 (`expand_tile`)
   and every row multiplied by it (`tile_gemm`). Both make the same bits for a row, so a row's
   result never depends on how many rows share the call (speculative verification's k + 1
   rows give the logits of k + 1 single-row steps; a batch, those of its requests alone).
   One exception: at avx2, 1 and 2 rows take the faster sum way, d (q . x) + m sum(x)
   (`sum_rows_n`, SUM_MAX_ROWS), whose bits differ from a row's among 3 or more.
   N is padded to a whole tile (zero rows, never written out). */

#define TILE_N 4

/* With int8 activations (int8_g16.h) a weight may instead be laid out 16 outputs wide ("G16",
   made at load by quantized.py), so that one integer-dot instruction makes 16 outputs'
   partial sums and each block's scales are applied once per 16 outputs and row:

       groups[ceil(N / 16)][K / 32] of
         Q4 (KIND_Q4_G16): half d[16], m[16]; uint8 qs[4][16][4]          320 bytes
                           qs[h][o][i] = output o's GGUF byte 4h + i: its low nibble is
                           weight 4h + i, its high nibble weight 16 + 4h + i
         Q8 (KIND_Q8_G16): half d[16]; uint8 u[8][16][4]                 544 bytes
                           u[g][o][i] = q + 128 of output o's weight 4g + i (so unsigned:
                           w = d (u - 128), i.e. w = d u + m with m = -128 d)

   N is padded to a whole group (zero blocks). Only gguf_linear_i8 and gguf_dequantize_f32
   read it (gguf_linear_f32 hands such a weight to gguf_linear_i8). */
#define G16 16

typedef struct { uint16_t d, m; uint8_t qs[16]; } block_q4;
typedef struct { uint16_t d; int8_t qs[32]; } block_q8;

enum { KIND_Q4 = 0, KIND_Q8 = 1, KIND_Q4_G16 = 2, KIND_Q8_G16 = 3 };

static inline int64_t g16_block_bytes(int kind) { return kind == KIND_Q4_G16 ? 320 : 544; }

static inline int64_t block_bytes(int kind) {
    return kind == KIND_Q4 ? (int64_t)sizeof(block_q4) : (int64_t)sizeof(block_q8);
}

/* IEEE half -> float in plain C (the AVX levels use F16C's instruction instead). */
static inline float half_to_float_c(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0x1F) bits = sign | 0x7F800000 | (mant << 13);           /* inf, nan */
    else if (exp != 0) bits = sign | ((exp + 112) << 23) | (mant << 13);  /* normal */
    else if (mant == 0) bits = sign;                                    /* zero */
    else {                                                              /* subnormal */
        exp = 113;
        while (!(mant & 0x400)) { mant <<= 1; exp--; }
        bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
    }
    union { uint32_t u; float f; } v = { bits };
    return v.f;
}

/* A block's scale and minimum as floats (a Q8 block has no minimum: 0). */
#define BLOCK_D(b) half_to_float((b)->d)
#define Q4_M(b) half_to_float((b)->m)

#if defined(__F16C__)
#include <immintrin.h>
/* A block's scale and minimum, [d, m, 0, 0] (a Q8 block: [d, 0, 0, 0]), in two instructions. */
static inline __m128 block_dm(const char* blocks, int kind, int j) {
    if (kind == KIND_Q4) {
        int32_t dm;
        memcpy(&dm, &((const block_q4*)blocks + j)->d, sizeof(dm));
        return _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    }
    return _mm_cvtph_ps(_mm_cvtsi32_si128(((const block_q8*)blocks + j)->d));
}
#endif
