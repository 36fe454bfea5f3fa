/* Integer-dot products of GGUF blocks with int8 activations (issue 24), as llama.cpp does on
   x86. Included by cpu_kernels.c after the level's header; gguf_linear_i8 there calls it.

   The activation rows are quantized once per call to blocks of 32 (llama.cpp's Q8_1): per row
   and block a scale d = max|x| / 127, quants p = rint(x / d) in -127..127 and s = d sum(p),
   d and s kept as float32 (llama.cpp rounds them to half). With the weights' blocks in the
   kernel layout (common.h: Q4 w = d q + m, q in 0..15; Q8 w = d q, q in -128..127):

       y[r, n] = sum_b  d_nb d_rb (q_nb . p_rb)  +  m_nb s_rb

   q . p is exact in 32-bit integers: AVX2 `maddubs` (u8 x s8 -> s16 pairs; never saturating
   here: 2 x 15 x 127 and 2 x 128 x 127 < 2^15) then `madd` with ones, on 256 bits (one block)
   at avx2 and 512 (two blocks) at avx512; `vpdpbusd` in one instruction with AVX512-VNNI
   (avx512vnni) or AVX-VNNI (avx2vnni: the same sums, so the same bits as avx2); the
   portable level plain integer loops. Q8 weights are signed: |q| .
   sign(p, q), as llama.cpp. A block costs one load of its quants and, per row, one product,
   one conversion and one FMA, where the float32 path widens every quant to a float.

   Activations: xq [M][K] int8 and xds [M][K / 32] pairs (d, s) as floats. */

#if defined(__AVX512F__)
#define I8_ROWS 4  /* rows of x per pass over a tile: 2 outputs x 4 rows of accumulators */
#else
#define I8_ROWS 2  /* 16 registers at AVX2 */
#endif
/* (Tiles only: weights laid out 16 wide, int8_g16.h, take int8 at every row count.)
   Beyond this many rows gguf_linear_i8 is gguf_linear_f32: the float32 path expands each tile
   once and multiplies every row by it, as fast from 16 rows and faster at 64 (one thread, CPU
   time, the default model's 30 layers + LM head per step: avx512vnni 8 rows 15.5 ms int8
   against 19.1, 16 rows 30.9 against 31.1, 64 rows 120 against 101; avx2 16 rows 53.9 against
   53.8). Up to it, a row's result is the bits of that row alone (each row has its own
   accumulators); beyond, the bits of its float32 product alone, which differs from its int8
   one by the activations' rounding (~1% of a product's size). int8 all the way would keep the
   int8 bits at every row count, for 1.14-1.6x the float32 kernel's time on a layer's linears
   at 9-64 rows (one thread, `benchmarks/linear_crossover.py --int8 --variant
   ...:-DI8_MAX_ROWS=1000000`). */
#ifndef I8_MAX_ROWS  /* (-D: benchmarks/linear_crossover.py --variant) */
#define I8_MAX_ROWS 8
#endif

/* One block of 32 values as int8 on the scale d: q = rint(v / d) clamped to -127..127 (half to
   even, as torch.round), ds = (d, d sum(q)); with AVX2 8 at a time, the same bits. `rest` (or
   NULL): what the rounding left, v - d q (where the level has FMA the compiler fuses it into
   one rounding, which can move a quant of the rest by one). Returns sum(q). */
static inline int32_t quantize_block_q8_on(const float* v, float d, int8_t* q, float* ds, float* rest) {
    const float id = d != 0.f ? 1.f / d : 0.f;
#if defined(__AVX2__)
    const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
    __m256 x[4];
    __m256i qi[4];
    for (int i = 0; i < 4; i++) {
        x[i] = _mm256_loadu_ps(v + 8 * i);
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(x[i], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        qi[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
    }
    /* 32 int32 -> 32 int8 in order: the packs interleave 128-bit lanes, the permute restores */
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]),
                                              _mm256_packs_epi32(qi[2], qi[3]));
    _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    ds[0] = d;
    ds[1] = d * (float)sum;
    if (rest) {
        const __m256 vd = _mm256_set1_ps(d);
        for (int i = 0; i < 4; i++)
            _mm256_storeu_ps(rest + 8 * i, _mm256_sub_ps(x[i], _mm256_mul_ps(vd, _mm256_cvtepi32_ps(qi[i]))));
    }
    return sum;
#else
    int32_t sum = 0;
    for (int i = 0; i < 32; i++) {
        float t = rintf(v[i] * id);
        t = t > 127.f ? 127.f : (t < -127.f ? -127.f : t);
        q[i] = (int8_t)t;
        sum += q[i];
    }
    ds[0] = d;
    ds[1] = d * (float)sum;
    if (rest) {
        for (int i = 0; i < 32; i++) {
            const float p = d * (float)q[i];
            rest[i] = v[i] - p;
        }
    }
    return sum;
#endif
}

/* One block of 32 values as int8 on its own scale d = max|v| / 127 (quantize_block_q8_on; a NaN
   counts as 0 in the maximum at every level). Returns sum(q). */
static inline int32_t quantize_block_q8(const float* v, int8_t* q, float* ds, float* rest) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++)  /* (a NaN x gives mx) */
        mx = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)), mx);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#else
    float amax = 0.f;
    for (int i = 0; i < 32; i++) {
        const float a = fabsf(v[i]);
        amax = a > amax ? a : amax;
    }
#endif
    return quantize_block_q8_on(v, amax / 127.f, q, ds, rest);
}

/* x's rows (`x_stride` apart) as int8 blocks: xq[r * K + k], xds[2 * (r * nb + b)] = d and
   [... + 1] = s. */
static void quantize_rows_q8(const float* x, int64_t x_stride, int64_t M, int64_t K, int8_t* xq,
                             float* xds) {
    const int64_t nb = K / 32;
    for (int64_t r = 0; r < M; r++)
        for (int64_t b = 0; b < nb; b++)
            quantize_block_q8(x + r * x_stride + b * 32, xq + r * K + b * 32, xds + 2 * (r * nb + b), NULL);
}

/* One row as two int8 rows (q, then q + K; their pairs ds, then ds + 2 K / 32): its blocks, then
   the blocks of what their rounding left on the fixed scale X2_REST of the first's d. The rest
   is within d / 2, so its quants within 128 (clamped to 127, which moves one only where the
   rest is within d / 512 of d / 2): as fine as on its own max / 127 (~d / 254, as 32 rests
   nearly reach d / 2), and the two rows' integer products q . w and q' . w make one,
   (q . w) 2^X2_SHIFT + q' . w, exact in int32 (int8_g16.h: one conversion and one scale for
   both). The first row's s is both rows' sum, d' (2^X2_SHIFT sum(q) + sum(q')) with
   d' = d X2_REST, and the second's 0: one minimum term m s for the two. */
#define X2_SHIFT 8
#define X2_REST (1.f / 256.f)
static void quantize_row_q8_x2(const float* x, int64_t K, int8_t* q, float* ds) {
    const int64_t nb = K / 32;
    float rest[32];
    for (int64_t b = 0; b < nb; b++) {
        const int32_t first = quantize_block_q8(x + b * 32, q + b * 32, ds + 2 * b, rest);
        const float d2 = ds[2 * b] * X2_REST;
        const int32_t second = quantize_block_q8_on(rest, d2, q + K + b * 32, ds + 2 * (nb + b), NULL);
        ds[2 * b + 1] = d2 * (float)(first * (1 << X2_SHIFT) + second);
        ds[2 * (nb + b) + 1] = 0.f;
    }
}

#if defined(__AVX2__)

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 8 int32 sums of 4 adjacent u8 x s8 products each. */
static inline __m256i dot_u8i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* A Q4 block's 32 quants as bytes in order: the low nibbles (0-15), then the high (16-31). */
static inline __m256i q4_bytes(const block_q4* b) {
    const __m128i raw = _mm_loadu_si128((const __m128i*)b->qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* Outputs j0 and j0 + 1 of a tile against `rows` rows of quantized x. Per block and row: the
   scales [d_w, m_w] * [d_x, s_x] in one multiply, d_w d_x applied to the 8 integer lanes by an
   FMA, and m_w s_x added in lane 1 of a 128-bit accumulator. `kind` and `rows` are constants
   where this is inlined. */
static inline __attribute__((always_inline)) void two_outputs_i8(
    const char* tile, const int kind, int64_t nb, int j0, const int8_t* xq, int64_t K,
    const float* xds, const int rows, float out[TILE_N][I8_ROWS]) {
    const int64_t bsize = block_bytes(kind);
    __m256 acc[2][I8_ROWS];
    __m128 macc[2][I8_ROWS];
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
            __m256i wq, wsign = _mm256_setzero_si256();
            if (kind == KIND_Q4) wq = q4_bytes((const block_q4*)blocks + j0 + jj);
            else {
                wsign = _mm256_loadu_si256((const __m256i*)((const block_q8*)blocks + j0 + jj)->qs);
                wq = _mm256_abs_epi8(wsign);
            }
            const __m128 dm = block_dm(blocks, kind, j0 + jj);
            for (int r = 0; r < rows; r++) {
                __m256i p = _mm256_loadu_si256((const __m256i*)(xq + r * K + b * 32));
                if (kind == KIND_Q8) p = _mm256_sign_epi8(p, wsign);
                const __m256 f = _mm256_cvtepi32_ps(dot_u8i8(wq, p));
                const __m128 ds = _mm_castpd_ps(_mm_load_sd((const double*)(xds + 2 * (r * nb + b))));
                const __m128 sc = _mm_mul_ps(dm, ds);
                acc[jj][r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(sc), f, acc[jj][r]);
                if (kind == KIND_Q4) macc[jj][r] = _mm_add_ps(macc[jj][r], sc);
            }
        }
    }
    for (int jj = 0; jj < 2; jj++)
        for (int r = 0; r < rows; r++)
            out[j0 + jj][r] = hsum256(acc[jj][r])
                              + _mm_cvtss_f32(_mm_shuffle_ps(macc[jj][r], macc[jj][r], 1));
}

#if defined(__AVX512F__)
/* 512-bit registers hold two blocks: outputs (j, j + 1) of a tile at the same block b, which
   meet the same 32 activations (broadcast to both halves). Per row and pair: one integer
   product, one conversion, the scales [d_j d_x x 8 | d_j+1 d_x x 8] in one multiply and an
   FMA, and [., ., m_j, m_j+1] s_x in a 128-bit accumulator: half the instructions per block
   of the 256-bit form. */
static inline __m512i dot_u8i8_512(__m512i u, __m512i s) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}

/* Two Q4 blocks' quants as bytes: [a low nibbles | a high | b low | b high]. */
static inline __m512i q4_bytes_pair(const block_q4* a, const block_q4* b) {
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a->qs)),
        _mm_loadu_si128((const __m128i*)b->qs), 1);
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    /* v = [a, b, a >> 4, b >> 4] by 128-bit lanes: take lanes 0, 2, 1, 3 */
    return _mm512_and_si512(_mm512_shuffle_i64x2(v, v, 0xD8), _mm512_set1_epi8(15));
}

static inline __attribute__((always_inline)) void tile_rows_i8_n(
    const char* tile, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[TILE_N][I8_ROWS]) {
    const int64_t bsize = block_bytes(kind);
    __m512 acc[2][I8_ROWS];
    __m128 macc[2][I8_ROWS];
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < rows; r++) {
            acc[p][r] = _mm512_setzero_ps();
            macc[p][r] = _mm_setzero_ps();
        }
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int64_t off = 0; off < TILE_N * bsize; off += 64)
            _mm_prefetch(blocks + 8 * TILE_N * bsize + off, _MM_HINT_T0);
        __m512i wq[2];
        __mmask64 neg[2] = {0, 0};
        __m512 d[2];
        __m128 dm2[2];
        for (int p = 0; p < 2; p++) {
            const int j = 2 * p;
            if (kind == KIND_Q4) {
                wq[p] = q4_bytes_pair((const block_q4*)blocks + j, (const block_q4*)blocks + j + 1);
            } else {
                const __m512i w = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)((const block_q8*)blocks + j)->qs)),
                    _mm256_loadu_si256((const __m256i*)((const block_q8*)blocks + j + 1)->qs), 1);
                neg[p] = _mm512_movepi8_mask(w);
                wq[p] = _mm512_abs_epi8(w);
            }
            const __m128 a = block_dm(blocks, kind, j), c = block_dm(blocks, kind, j + 1);
            d[p] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_broadcastss_ps(a)),
                                      _mm256_broadcastss_ps(c), 1);
            dm2[p] = _mm_unpacklo_ps(a, c);  /* [d_j, d_j+1, m_j, m_j+1] */
        }
        for (int r = 0; r < rows; r++) {
            const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(xq + r * K + b * 32)));
            const float* ds = xds + 2 * (r * nb + b);
            const __m512 dx = _mm512_set1_ps(ds[0]);
            for (int p = 0; p < 2; p++) {
                const __m512i xs = kind == KIND_Q8 ? _mm512_mask_sub_epi8(x, neg[p], _mm512_setzero_si512(), x) : x;
                const __m512 f = _mm512_cvtepi32_ps(dot_u8i8_512(wq[p], xs));
                acc[p][r] = _mm512_fmadd_ps(_mm512_mul_ps(d[p], dx), f, acc[p][r]);
                if (kind == KIND_Q4) macc[p][r] = _mm_fmadd_ps(dm2[p], _mm_set1_ps(ds[1]), macc[p][r]);
            }
        }
    }
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < rows; r++) {
            float m[4];
            _mm_storeu_ps(m, macc[p][r]);
            out[2 * p][r] = hsum256(_mm512_castps512_ps256(acc[p][r])) + m[2];
            out[2 * p + 1][r] = hsum256(_mm512_extractf32x8_ps(acc[p][r], 1)) + m[3];
        }
}
#else
static inline __attribute__((always_inline)) void tile_rows_i8_n(
    const char* tile, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[TILE_N][I8_ROWS]) {
    for (int j0 = 0; j0 < TILE_N; j0 += 2) two_outputs_i8(tile, kind, nb, j0, xq, K, xds, rows, out);
}
#endif

/* Specialized per block kind and row count, so that the inner loops have no branches. */
#define I8_CASE(KIND, R) case R: tile_rows_i8_n(tile, KIND, nb, xq, K, xds, R, out); break
static void tile_rows_i8(const char* tile, int kind, int64_t nb, const int8_t* xq, int64_t K,
                         const float* xds, int64_t rows, float out[TILE_N][I8_ROWS]) {
    if (kind == KIND_Q4) {
        switch (rows) {
            I8_CASE(KIND_Q4, 1); I8_CASE(KIND_Q4, 2);
#if I8_ROWS == 4
            I8_CASE(KIND_Q4, 3); I8_CASE(KIND_Q4, 4);
#endif
        }
    } else {
        switch (rows) {
            I8_CASE(KIND_Q8, 1); I8_CASE(KIND_Q8, 2);
#if I8_ROWS == 4
            I8_CASE(KIND_Q8, 3); I8_CASE(KIND_Q8, 4);
#endif
        }
    }
}
#undef I8_CASE

#else  /* portable: plain integer loops */

static void tile_rows_i8(const char* tile, int kind, int64_t nb, const int8_t* xq, int64_t K,
                         const float* xds, int64_t rows, float out[TILE_N][I8_ROWS]) {
    const int64_t bsize = block_bytes(kind);
    float acc[TILE_N][I8_ROWS];
    memset(acc, 0, sizeof(acc));
    for (int64_t b = 0; b < nb; b++) {
        const char* blocks = tile + b * TILE_N * bsize;
        for (int j = 0; j < TILE_N; j++) {
            int8_t q[32];
            float dw, mw = 0.f;
            if (kind == KIND_Q4) {
                const block_q4* blk = (const block_q4*)blocks + j;
                for (int i = 0; i < 16; i++) {
                    q[i] = (int8_t)(blk->qs[i] & 15);
                    q[i + 16] = (int8_t)(blk->qs[i] >> 4);
                }
                dw = BLOCK_D(blk);
                mw = Q4_M(blk);
            } else {
                const block_q8* blk = (const block_q8*)blocks + j;
                memcpy(q, blk->qs, 32);
                dw = BLOCK_D(blk);
            }
            for (int64_t r = 0; r < rows; r++) {
                const int8_t* p = xq + r * K + b * 32;
                int32_t sumi = 0;
                for (int i = 0; i < 32; i++) sumi += (int32_t)q[i] * (int32_t)p[i];
                const float* ds = xds + 2 * (r * nb + b);
                acc[j][r] += dw * ds[0] * (float)sumi + mw * ds[1];
            }
        }
    }
    memcpy(out, acc, sizeof(acc));
}

#endif
