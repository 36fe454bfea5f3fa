/* int8 activations against weights laid out 16 outputs wide (G16, common.h). Included by
   cpu_kernels.c after int8.h, whose activation quantization (quantize_rows_q8) it shares;
   gguf_linear_i8 there calls it for such weights.

   The 4 quants of one output and 4 inputs sit in one 32-bit lane, 16 outputs across a 512-bit
   register (8 across 256 bits): one integer-dot instruction against 4 activations broadcast to
   every lane gives 16 outputs' partial sums, 8 of them sum a block (exactly, in int32), and the
   block's terms, d_w d_x (q . p) + m_w s_x, take one conversion, one multiply and two FMAs per
   16 outputs and row. The tiled kernel (int8.h) pays that per 2 outputs (and more per
   instruction of products): here ~3x less work per row, so that the k + 1 rows of a
   speculative step cost little more than one. Per (row, output) the order of the terms is
   that of the blocks, with every row its own accumulator: a row's bits do not depend on the
   rows beside it, nor on how many rows the call has (G16_ROWS is only how many share a pass
   over the weights).

   Levels: avx512vnni and avx2vnni (vpdpbusd, Q4 and Q8; AVX-VNNI's at 256 bits); avx512 and
   avx2: maddubs (u8 x s8 -> s16 pairs)
   and madd, for Q4 summed over a block's 8 groups in s16 (8 x 2 x 15 x 127 < 2^15); Q8's
   u = q + 128 would saturate maddubs (2 x 255 x 127), so there each group takes q = u - 128
   back and multiplies |q| by p with q's sign (2 x 128 x 127 < 2^15, as llama.cpp does), and
   its term is d_w d_x (q . p) with no minimum; portable: none (it never runs the GGUF
   kernels). */

/* (numbers, not the enum: the preprocessor reads them) */
#define G16_Q4 1  /* 1 << KIND_Q4 */
#define G16_Q8 2  /* 1 << KIND_Q8 */

#if defined(__AVX512F__)
#define G16_ROWS 8
#define G16_KINDS (G16_Q4 | G16_Q8)

/* q . p of one row's block for 16 outputs: w[g] = the 16 outputs' quants of inputs 4g..4g+3,
   xr = the row's 8 groups of 4 int8 activations. */
static inline __attribute__((always_inline)) __m512i g16_dot(const __m512i w[8], const int32_t* xr) {
#if defined(__AVX512VNNI__)
    __m512i s0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xr[0]));
    __m512i s1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], _mm512_set1_epi32(xr[1]));
    for (int g = 2; g < 8; g += 2) {
        s0 = _mm512_dpbusd_epi32(s0, w[g], _mm512_set1_epi32(xr[g]));
        s1 = _mm512_dpbusd_epi32(s1, w[g + 1], _mm512_set1_epi32(xr[g + 1]));
    }
    return _mm512_add_epi32(s0, s1);
#else
    __m512i t0 = _mm512_maddubs_epi16(w[0], _mm512_set1_epi32(xr[0]));
    __m512i t1 = _mm512_maddubs_epi16(w[1], _mm512_set1_epi32(xr[1]));
    for (int g = 2; g < 8; g += 2) {
        t0 = _mm512_add_epi16(t0, _mm512_maddubs_epi16(w[g], _mm512_set1_epi32(xr[g])));
        t1 = _mm512_add_epi16(t1, _mm512_maddubs_epi16(w[g + 1], _mm512_set1_epi32(xr[g + 1])));
    }
    return _mm512_madd_epi16(_mm512_add_epi16(t0, t1), _mm512_set1_epi16(1));
#endif
}

/* A block's quants for 16 outputs (w[g]: inputs 4g..4g+3; Q4 from its nibbles, Q8 its u = q +
   128) and the factor of its minimum term m s_x (Q4: m; Q8: -128 d, taking the 128 back). */
static inline __attribute__((always_inline)) __m512 g16_weights(const char* blk, const int kind,
                                                                __m512 d, __m512i w[8]) {
    if (kind == KIND_Q4_G16) {
        const __m512i low = _mm512_set1_epi8(15);
        for (int h = 0; h < 4; h++) {
            const __m512i v = _mm512_loadu_si512(blk + 64 + 64 * h);
            w[h] = _mm512_and_si512(v, low);
            w[4 + h] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 32)));
    }
    for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512(blk + 32 + 64 * g);
    return _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
}

#if !defined(__AVX512VNNI__)
/* Q8 without vpdpbusd: q . p of `rows` rows' block into s[r], a half of the 8 groups at a
   time (|q| and q's sign mask for 4 groups in registers). */
static inline __attribute__((always_inline)) void g16_dot_q8(
    const char* blk, const int8_t* xq, int64_t K, int64_t b, const int rows, __m512i s[G16_ROWS]) {
    const __m512i bias = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    for (int r = 0; r < rows; r++) s[r] = zero;
    for (int gh = 0; gh < 8; gh += 4) {
        __m512i aq[4];
        __mmask64 neg[4];
        for (int i = 0; i < 4; i++) {
            const __m512i q = _mm512_xor_si512(_mm512_loadu_si512(blk + 32 + 64 * (gh + i)), bias);
            aq[i] = _mm512_abs_epi8(q);
            neg[i] = _mm512_movepi8_mask(q);
        }
        for (int r = 0; r < rows; r++) {
            const int32_t* xr = (const int32_t*)(xq + r * K + b * 32);
            for (int i = 0; i < 4; i++) {
                const __m512i x = _mm512_set1_epi32(xr[gh + i]);
                const __m512i xs = _mm512_mask_sub_epi8(x, neg[i], zero, x);
                s[r] = _mm512_add_epi32(s[r], _mm512_madd_epi16(_mm512_maddubs_epi16(aq[i], xs),
                                                                _mm512_set1_epi16(1)));
            }
        }
    }
}
#endif

/* y[r, 16 outputs] of one group for `rows` rows of quantized x (out[r][o]). */
static inline __attribute__((always_inline)) void g16_rows_n(
    const char* grp, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[G16_ROWS][G16]) {
    const int64_t gb = g16_block_bytes(kind);
    __m512 acc[G16_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char* blk = grp + b * gb;
        for (int64_t off = 0; off < gb; off += 64) _mm_prefetch(blk + 4 * gb + off, _MM_HINT_T0);
#if !defined(__AVX512VNNI__)
        if (kind == KIND_Q8_G16) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
            __m512i sumi[G16_ROWS];
            g16_dot_q8(blk, xq, K, b, rows, sumi);
            for (int r = 0; r < rows; r++)
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[r]),
                                         _mm512_mul_ps(d, _mm512_set1_ps(xds[2 * (r * nb + b)])), acc[r]);
            continue;
        }
#endif
        __m512i w[8];
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
        const __m512 m = g16_weights(blk, kind, d, w);
        for (int r = 0; r < rows; r++) {
            const float* ds = xds + 2 * (r * nb + b);
            const __m512 f = _mm512_cvtepi32_ps(g16_dot(w, (const int32_t*)(xq + r * K + b * 32)));
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(ds[0])), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(ds[1]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

/* int8x2 (quantize_row_q8_x2): G16_X2_ROWS rows a pass, each as its two int8 rows at xq + 2 r K
   and xq + (2 r + 1) K (pairs at xds + 2 (2 r) nb and + 2 (2 r + 1) nb), whose integer sums of
   a block make one, S = (q . w) 2^X2_SHIFT + q' . w (exact in int32: Q4 32 x 15 x 127 x 2^8 <
   2^24, Q8 32 x 255 x 127 x 2^8 < 2^31), taken by one conversion and one scale d_w d': half the
   float work of the two rows apart, and one minimum term. Each row's registers: its two sums
   and its accumulator, so that 6 rows share a pass over the weights where 4 did. With
   vpdpbusd, g16_pair_rows below takes two groups a pass instead (this one then only a lone
   last group). */
#ifndef G16_X2_ROWS
#define G16_X2_ROWS 6
#endif
#define G16_X2_KINDS (G16_Q4 | G16_Q8)

/* (q . w) 2^X2_SHIFT + q' . w of one row's block for 16 outputs (see g16_dot). */
static inline __attribute__((always_inline)) __m512i g16_dot_x2(const __m512i w[8], const int32_t* xh,
                                                                const int32_t* xl) {
#if defined(__AVX512VNNI__)
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xh[0]));
    __m512i t = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[0], _mm512_set1_epi32(xl[0]));
    for (int g = 1; g < 8; g++) {
        s = _mm512_dpbusd_epi32(s, w[g], _mm512_set1_epi32(xh[g]));
        t = _mm512_dpbusd_epi32(t, w[g], _mm512_set1_epi32(xl[g]));
    }
    return _mm512_add_epi32(_mm512_slli_epi32(s, X2_SHIFT), t);
#else
    return _mm512_add_epi32(_mm512_slli_epi32(g16_dot(w, xh), X2_SHIFT), g16_dot(w, xl));
#endif
}

/* y[r, 16 outputs] of one group for `rows` (<= G16_X2_ROWS) int8x2 rows (out[r][o]). */
static inline __attribute__((always_inline)) void g16_x2_rows_n(
    const char* grp, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[G16_X2_ROWS][G16]) {
    const int64_t gb = g16_block_bytes(kind);
    __m512 acc[G16_X2_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char* blk = grp + b * gb;
        for (int64_t off = 0; off < gb; off += 64) _mm_prefetch(blk + 4 * gb + off, _MM_HINT_T0);
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk));
#if !defined(__AVX512VNNI__)
        if (kind == KIND_Q8_G16) {  /* (no minimum term: |q| . p with q's sign) */
            for (int r0 = 0; r0 < rows; r0 += G16_ROWS / 2) {
                const int n = rows - r0 < G16_ROWS / 2 ? rows - r0 : G16_ROWS / 2;
                __m512i sumi[G16_ROWS];
                g16_dot_q8(blk, xq + 2 * r0 * K, K, b, 2 * n, sumi);
                for (int r = 0; r < n; r++) {
                    const __m512i S = _mm512_add_epi32(_mm512_slli_epi32(sumi[2 * r], X2_SHIFT),
                                                       sumi[2 * r + 1]);
                    const float d2 = xds[2 * ((2 * (r0 + r) + 1) * nb + b)];
                    acc[r0 + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(S), _mm512_mul_ps(d, _mm512_set1_ps(d2)),
                                                  acc[r0 + r]);
                }
            }
            continue;
        }
#endif
        __m512i w[8];
        const __m512 m = g16_weights(blk, kind, d, w);
        for (int r = 0; r < rows; r++) {
            const int8_t* xh = xq + 2 * r * K + b * 32;
            const float* dh = xds + 2 * (2 * r * nb + b);   /* d, both rows' s */
            const float d2 = xds[2 * ((2 * r + 1) * nb + b)];
            const __m512 f = _mm512_cvtepi32_ps(g16_dot_x2(w, (const int32_t*)xh, (const int32_t*)(xh + K)));
            acc[r] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(d2)), acc[r]);
            acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(dh[1]), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) _mm512_storeu_ps(out[r], acc[r]);
}

#if defined(__AVX512VNNI__)
/* Two groups at once (32 outputs; grp and grp + gbytes), rows of int8x2 (parts 2, up to
   G16_X2P_ROWS: each row's sums as g16_x2_rows_n's) or int8 (parts 1, up to G16_X1P_ROWS:
   g16_rows_n's), the same bits as one group a pass: each activation broadcast serves both
   groups' products, where one group's pass takes one broadcast a product. A block in two
   halves of 4 groups of inputs (Q4: its low nibbles, then its high), so that both groups'
   weights of a half take 8 registers; a row's sums and accumulators 6 (int8x2) or 4. At 64
   rows the default model's gate|up product ran 9.3-9.5 -> 11.5 G products/s at int8x2 against
   one group a pass (EPYC, 2 threads); 3 rows a pass (spilling) 10.9-11.1. */
#define G16_X2P_ROWS 2  /* (g16_pair_rows's cases) */
#define G16_X1P_ROWS 4
#define G16_PAIR_ROWS (G16_X1P_ROWS > G16_X2P_ROWS ? G16_X1P_ROWS : G16_X2P_ROWS)
static inline __attribute__((always_inline)) void g16_pair_rows_n(
    const char* grp, int64_t gbytes, const int kind, const int parts, int64_t nb, const int8_t* xq,
    int64_t K, const float* xds, const int rows, float out[G16_PAIR_ROWS][2 * G16]) {
    const int64_t gb = g16_block_bytes(kind);
    __m512 acc[G16_PAIR_ROWS][2];
    for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const char* blk[2] = {grp + b * gb, grp + gbytes + b * gb};
        for (int j = 0; j < 2; j++)
            for (int64_t off = 0; off < gb; off += 64) _mm_prefetch(blk[j] + 4 * gb + off, _MM_HINT_T0);
        __m512i S[G16_PAIR_ROWS][2], T[G16_PAIR_ROWS][2];  /* T: the second int8 rows' */
        for (int r = 0; r < rows; r++)
            S[r][0] = S[r][1] = T[r][0] = T[r][1] = _mm512_setzero_si512();
        for (int h = 0; h < 2; h++) {
            __m512i w[2][4];
            for (int j = 0; j < 2; j++)
                for (int i = 0; i < 4; i++) {
                    if (kind == KIND_Q4_G16) {
                        const __m512i v = _mm512_loadu_si512(blk[j] + 64 + 64 * i);
                        w[j][i] = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(15));
                    } else {
                        w[j][i] = _mm512_loadu_si512(blk[j] + 32 + 64 * (4 * h + i));
                    }
                }
            for (int r = 0; r < rows; r++) {
                const int32_t* xh = (const int32_t*)(xq + parts * r * K + b * 32) + 4 * h;
                const int32_t* xl = xh + K / 4;  /* (parts 2: the row's second int8 row) */
                for (int i = 0; i < 4; i++) {
                    const __m512i ph = _mm512_set1_epi32(xh[i]);
                    S[r][0] = _mm512_dpbusd_epi32(S[r][0], w[0][i], ph);
                    S[r][1] = _mm512_dpbusd_epi32(S[r][1], w[1][i], ph);
                    if (parts == 2) {
                        const __m512i pl = _mm512_set1_epi32(xl[i]);
                        T[r][0] = _mm512_dpbusd_epi32(T[r][0], w[0][i], pl);
                        T[r][1] = _mm512_dpbusd_epi32(T[r][1], w[1][i], pl);
                    }
                }
            }
        }
        for (int j = 0; j < 2; j++) {
            const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)blk[j]));
            const __m512 m = kind == KIND_Q4_G16 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk[j] + 32)))
                                                 : _mm512_mul_ps(d, _mm512_set1_ps(-128.f));
            for (int r = 0; r < rows; r++) {
                /* int8x2: the first row's s (both rows' sums), the second row's d; int8: its own */
                const float s = xds[2 * (parts * r * nb + b) + 1];
                const float dx = xds[2 * ((parts * r + parts - 1) * nb + b)];
                const __m512i sum = parts == 2 ? _mm512_add_epi32(_mm512_slli_epi32(S[r][j], X2_SHIFT), T[r][j])
                                               : S[r][j];
                acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc[r][j]);
                acc[r][j] = _mm512_fmadd_ps(m, _mm512_set1_ps(s), acc[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        _mm512_storeu_ps(out[r], acc[r][0]);
        _mm512_storeu_ps(out[r] + G16, acc[r][1]);
    }
}
#endif

#elif defined(__AVX2__)
#define G16_ROWS 4
#define G16_KINDS (G16_Q4 | G16_Q8)

/* A sum as it stands, in a register: GCC otherwise reorders a row's additions into a tree of
   every product of the block, which spills them all (16 registers). */
#define G16_KEEP(t) __asm__("" : "+x"(t))

/* t += the products of 8 outputs' quants (4 inputs each, w) with 4 activations (x) broadcast:
   AVX-VNNI's vpdpbusd sums them in int32; maddubs sums pairs in s16, which G16_SUM adds up
   once a block (Q4: 8 x 2 x 15 x 127 < 2^15). */
#if defined(__AVXVNNI__)
#define G16_ACC(t, w, x) do { (t) = _mm256_dpbusd_avx_epi32((t), (w), (x)); G16_KEEP(t); } while (0)
#define G16_SUM(t) (t)
#else
#define G16_ACC(t, w, x) do { (t) = _mm256_add_epi16((t), _mm256_maddubs_epi16((w), (x))); G16_KEEP(t); } while (0)
#define G16_SUM(t) _mm256_madd_epi16((t), _mm256_set1_epi16(1))
#endif

/* 16 registers: a row's float and integer sums (2 x 4 rows) stay in them only if the weights
   take 4 (the quants of 4 groups: a block's 8 in two steps, Q8 without vpdpbusd 2 groups at a
   time with their magnitudes), not 8: spilled, they had made a 16-row product 1.2x slower. */
static inline __attribute__((always_inline)) void g16_rows_n(
    const char* grp, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[G16_ROWS][G16]) {
    const int64_t gb = g16_block_bytes(kind);
    for (int half = 0; half < 2; half++) {  /* the group's two halves of 8 outputs */
        __m256 acc[G16_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const char* blk = grp + b * gb;
            if (half == 0)
                for (int64_t off = 0; off < gb; off += 64) _mm_prefetch(blk + 4 * gb + off, _MM_HINT_T0);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * half)));
            __m256i t[G16_ROWS];
            for (int r = 0; r < rows; r++) t[r] = _mm256_setzero_si256();
#if !defined(__AVXVNNI__)
            if (kind == KIND_Q8_G16) {  /* |q| . (p with q's sign), summed in int32 a group */
                const __m256i bias = _mm256_set1_epi8((char)0x80);
                for (int g = 0; g < 8; g += 2) {
                    __m256i q[2], aq[2];
                    for (int i = 0; i < 2; i++) {
                        q[i] = _mm256_xor_si256(
                            _mm256_loadu_si256((const __m256i*)(blk + 32 + 64 * (g + i) + 32 * half)), bias);
                        aq[i] = _mm256_abs_epi8(q[i]);
                    }
                    for (int r = 0; r < rows; r++) {
                        const int32_t* xr = (const int32_t*)(xq + r * K + b * 32);
                        for (int i = 0; i < 2; i++) {
                            const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xr[g + i]), q[i]);
                            t[r] = _mm256_add_epi32(t[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aq[i], xs),
                                                                            _mm256_set1_epi16(1)));
                            G16_KEEP(t[r]);
                        }
                    }
                }
                for (int r = 0; r < rows; r++)
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t[r]),
                                             _mm256_mul_ps(d, _mm256_set1_ps(xds[2 * (r * nb + b)])), acc[r]);
                continue;
            }
#endif
            __m256 m;
            if (kind == KIND_Q4_G16) {
                const __m256i low = _mm256_set1_epi8(15);
                for (int hi = 0; hi < 2; hi++) {  /* low nibbles: groups 0-3; high: 4-7 */
                    __m256i w[4];
                    for (int h = 0; h < 4; h++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 + 64 * h + 32 * half));
                        w[h] = _mm256_and_si256(hi ? _mm256_srli_epi16(v, 4) : v, low);
                    }
                    for (int r = 0; r < rows; r++) {
                        const int32_t* xr = (const int32_t*)(xq + r * K + b * 32) + 4 * hi;
                        for (int h = 0; h < 4; h++) G16_ACC(t[r], w[h], _mm256_set1_epi32(xr[h]));
                    }
                }
                m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * half)));
            } else {  /* Q8 with AVX-VNNI: u . p = q . p + 128 sum(p), taken back by m s_x */
                for (int g = 0; g < 8; g += 4) {
                    __m256i w[4];
                    for (int i = 0; i < 4; i++)
                        w[i] = _mm256_loadu_si256((const __m256i*)(blk + 32 + 64 * (g + i) + 32 * half));
                    for (int r = 0; r < rows; r++) {
                        const int32_t* xr = (const int32_t*)(xq + r * K + b * 32) + g;
                        for (int i = 0; i < 4; i++) G16_ACC(t[r], w[i], _mm256_set1_epi32(xr[i]));
                    }
                }
                m = _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
            }
            for (int r = 0; r < rows; r++) {
                const float* ds = xds + 2 * (r * nb + b);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(G16_SUM(t[r])),
                                         _mm256_mul_ps(d, _mm256_set1_ps(ds[0])), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(ds[1]), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
    }
}

/* int8x2 (quantize_row_q8_x2) with AVX-VNNI, as at AVX-512 (g16_x2_rows_n there): a row's two
   int8 rows' sums of a block make one, (q . w) 2^X2_SHIFT + q' . w, before one conversion and
   one scale, and one minimum term; 2 rows a pass (3 measured the same). gate|up at 64 rows
   4.5-4.6 -> 5.2-5.3 G products/s (EPYC capped at avx2vnni). Without vpdpbusd the maddubs,
   adds and broadcasts are most of the work, and the same kernel measured no faster (4.5-4.6
   either way), so plain AVX2 keeps a row's two int8 rows apart (g16_rows_n). */
#if defined(__AVXVNNI__)
#define G16_X2_ROWS 2
#define G16_X2_KINDS (G16_Q4 | G16_Q8)
static inline __attribute__((always_inline)) void g16_x2_rows_n(
    const char* grp, const int kind, int64_t nb, const int8_t* xq, int64_t K, const float* xds,
    const int rows, float out[G16_X2_ROWS][G16]) {
    const int64_t gb = g16_block_bytes(kind);
    for (int half = 0; half < 2; half++) {  /* the group's two halves of 8 outputs */
        __m256 acc[G16_X2_ROWS];
        for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const char* blk = grp + b * gb;
            if (half == 0)
                for (int64_t off = 0; off < gb; off += 64) _mm_prefetch(blk + 4 * gb + off, _MM_HINT_T0);
            __m256i S[G16_X2_ROWS], T[G16_X2_ROWS];
            for (int r = 0; r < rows; r++) S[r] = T[r] = _mm256_setzero_si256();
            for (int g = 0; g < 8; g += 4) {  /* Q4: low nibbles, groups 0-3; high: 4-7 */
                __m256i w[4];
                for (int i = 0; i < 4; i++) {
                    if (kind == KIND_Q4_G16) {
                        const __m256i v = _mm256_loadu_si256((const __m256i*)(blk + 64 + 64 * i + 32 * half));
                        w[i] = _mm256_and_si256(g ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(15));
                    } else {
                        w[i] = _mm256_loadu_si256((const __m256i*)(blk + 32 + 64 * (g + i) + 32 * half));
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const int32_t* xh = (const int32_t*)(xq + 2 * r * K + b * 32) + g;
                    const int32_t* xl = (const int32_t*)(xq + (2 * r + 1) * K + b * 32) + g;
                    for (int i = 0; i < 4; i++) {
                        G16_ACC(S[r], w[i], _mm256_set1_epi32(xh[i]));
                        G16_ACC(T[r], w[i], _mm256_set1_epi32(xl[i]));
                    }
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 16 * half)));
            const __m256 m = kind == KIND_Q4_G16
                                 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(blk + 32 + 16 * half)))
                                 : _mm256_mul_ps(d, _mm256_set1_ps(-128.f));
            for (int r = 0; r < rows; r++) {
                const float s = xds[2 * (2 * r * nb + b) + 1];
                const float d2 = xds[2 * ((2 * r + 1) * nb + b)];
                const __m256i sum = _mm256_add_epi32(_mm256_slli_epi32(G16_SUM(S[r]), X2_SHIFT), G16_SUM(T[r]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(d2)), acc[r]);
                acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(s), acc[r]);
            }
        }
        for (int r = 0; r < rows; r++) _mm256_storeu_ps(out[r] + 8 * half, acc[r]);
    }
}
#endif
#undef G16_ACC
#undef G16_SUM
#undef G16_KEEP

#else
#define G16_ROWS 1
#define G16_KINDS 0
#endif

#if G16_KINDS
/* Specialized per block kind and row count, so that the inner loops have no branches. */
#define G16_CASE(KIND, R) case R: g16_rows_n(grp, KIND, nb, xq, K, xds, R, out); break
#if G16_ROWS == 8
#define G16_CASES(KIND) switch (rows) { \
    G16_CASE(KIND, 1); G16_CASE(KIND, 2); G16_CASE(KIND, 3); G16_CASE(KIND, 4); \
    G16_CASE(KIND, 5); G16_CASE(KIND, 6); G16_CASE(KIND, 7); G16_CASE(KIND, 8); }
#else
#define G16_CASES(KIND) switch (rows) { \
    G16_CASE(KIND, 1); G16_CASE(KIND, 2); G16_CASE(KIND, 3); G16_CASE(KIND, 4); }
#endif
static void g16_rows(const char* grp, int kind, int64_t nb, const int8_t* xq, int64_t K,
                     const float* xds, int64_t rows, float out[G16_ROWS][G16]) {
    if (kind == KIND_Q4_G16) G16_CASES(KIND_Q4_G16)
    else G16_CASES(KIND_Q8_G16)
}
#undef G16_CASES
#undef G16_CASE
#ifdef G16_X2_ROWS
#define G16_X2_CASE(KIND, R) case R: g16_x2_rows_n(grp, KIND, nb, xq, K, xds, R, out); break
#if G16_X2_ROWS == 2
#define G16_X2_CASES(KIND) switch (rows) { G16_X2_CASE(KIND, 1); G16_X2_CASE(KIND, 2); }
#elif G16_X2_ROWS == 3
#define G16_X2_CASES(KIND) switch (rows) { \
    G16_X2_CASE(KIND, 1); G16_X2_CASE(KIND, 2); G16_X2_CASE(KIND, 3); }
#elif G16_X2_ROWS == 6
#define G16_X2_CASES(KIND) switch (rows) { \
    G16_X2_CASE(KIND, 1); G16_X2_CASE(KIND, 2); G16_X2_CASE(KIND, 3); G16_X2_CASE(KIND, 4); \
    G16_X2_CASE(KIND, 5); G16_X2_CASE(KIND, 6); }
#else
#define G16_X2_CASES(KIND) switch (rows) { \
    G16_X2_CASE(KIND, 1); G16_X2_CASE(KIND, 2); G16_X2_CASE(KIND, 3); G16_X2_CASE(KIND, 4); }
#endif
static void g16_x2_rows(const char* grp, int kind, int64_t nb, const int8_t* xq, int64_t K,
                        const float* xds, int64_t rows, float out[G16_X2_ROWS][G16]) {
    if (kind == KIND_Q4_G16) G16_X2_CASES(KIND_Q4_G16)
    else if (G16_X2_KINDS & G16_Q8) G16_X2_CASES(KIND_Q8_G16)
}
#undef G16_X2_CASES
#undef G16_X2_CASE
#endif
#ifdef G16_PAIR_ROWS
#define G16_PAIR_CASE(KIND, P, R) \
    case R: g16_pair_rows_n(grp, gbytes, KIND, P, nb, xq, K, xds, R, out); break
#define G16_PAIR_CASES(KIND) \
    if (parts == 2) switch (rows) { G16_PAIR_CASE(KIND, 2, 1); G16_PAIR_CASE(KIND, 2, 2); } \
    else switch (rows) { G16_PAIR_CASE(KIND, 1, 1); G16_PAIR_CASE(KIND, 1, 2); \
                         G16_PAIR_CASE(KIND, 1, 3); G16_PAIR_CASE(KIND, 1, 4); }
/* `rows` rows (of `parts` int8 rows each) against the two groups at grp (g16_pair_rows_n). */
static void g16_pair_rows(const char* grp, int64_t gbytes, int kind, int parts, int64_t nb,
                          const int8_t* xq, int64_t K, const float* xds, int64_t rows,
                          float out[G16_PAIR_ROWS][2 * G16]) {
    if (kind == KIND_Q4_G16) { G16_PAIR_CASES(KIND_Q4_G16) }
    else { G16_PAIR_CASES(KIND_Q8_G16) }
}
#undef G16_PAIR_CASES
#undef G16_PAIR_CASE
#endif
#endif
