/* tpkit's small-batch products from stored weights: y[m, n] = sum_k x[m, k] * W[n, k], W decoded as it streams.

   Decode multiplies a few activation rows by the whole weight: the time is reading the weight from memory, so each
   weight row is read once, decoded in registers (no dense copy), and multiplied by every activation row while it is
   in the cache, the bytes a few KiB ahead asked for meanwhile. With AVX-512 (`native.py` builds it with `-O3
   -march=native`), intrinsics: up to MC_MAX activation rows share each decoded weight row, each keeping 4 chains of
   16 float32 lanes; with AVX2 (and FMA, F16C) the same at 8 lanes; elsewhere plain C that the compiler vectorizes,
   32 lanes per dot product, one row at a time. In AVX2 builds, integer weights times bf16 activations take integer
   products instead (X16: x made int16 per run, `vpmaddwd`), which need a quarter of the instructions.
   Where the CPU has AVX512-BF16 and the activations are bf16 values (`xb`), bf16, int4 and FP8 weights are
   multiplied as bf16 words by its dot product instead (`dot_bf16`): the same float32 sums of exact products, with no
   decode to float32 (int4: a byte lookup per nibble; FP8: two bit operations per 32 values), which was the int4 and
   FP8 loops' bound. Where it has AVX512-VNNI, int8 and int4 weights times bf16 activations take its byte products
   instead (VNNI_RUNS: x made 15-bit integers per run, split into two bytes).

   Weight kinds (`kind`), each `[N, K]` row-major in its stored bytes:
     0  bf16 bits                                 1  fp16 bits
     2  int8 values                               3  uint8 values (compressed-tensors' packed 8-bit words: value+128)
     4  uint4 pairs: byte j of a row holds k = 2j (low nibble) and 2j + 1 (high nibble), values unsigned 0..15
     5  FP8 e4m3fn bits                            6  float32 (a float32 model's dense weight)
   fp16 and FP8 bits are placed in a float32's exponent and mantissa (normal and subnormal values alike): that float
   is the value times 2^-112 (fp16) or 2^-120 (FP8), and each output is multiplied back once at the end. x is
   scaled by 2^64 first (exact), so that such a weight times a small activation stays a normal float32. (An FP8
   subnormal, below 2^-6, is still a denormal input to the float32 loops; the bf16 dot products add those apart.)
   Scales and zero points (optional) cover blocks of `bh` rows x `bw` columns: entry (n / bh, k / bw) of a
   `[ceil(N / bh), KB]` table, read where the checkpoint stored them (no table is made at load, so a layer holds no
   more than its stored tensors). Scales (`scale_kind`): 0 float32, 1 bf16 bits, 2 fp16 bits, each converted to the
   float32 of the same value (exactly: integer operations only). Zero points (`zero_kind`): 0 none, 1 int8 values
   (the table), 2 int32 words packing `32 / zero_bits` rows' values along the rows, each stored plus 2^(zero_bits-1)
   (compressed-tensors' packed zero points). `offset` (a float32 integer) is the values' storage offset (8 for
   compressed-tensors' int4, 128 for its packed int8 words): the block's zero is z + offset, a constant where there
   are no zero points. The product is factored per block, y += s * (sum_k x q - (z + offset) * sum_k x), so the inner
   loop is a decode and a multiply-add. Integers and FP8 values are exact in float32; the sums are float32. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 32
#define MC_MAX 4 /* activation rows that share one decode of a weight row (AVX-512 and AVX2 loops) */
/* Bytes asked for ahead of the row being multiplied, into every cache level: the weight streams from memory once
   and the decode is arithmetic, so without asking ahead the two took turns (int4 rows of 1 KiB, cold: 3.3 GB/s, and
   6.4 GB/s asking 4 KiB ahead, which is what the decode does in cache; further ahead, or past the caches, was
   slower on the 2-core box). */
#define AHEAD 4096
#if (defined(__AVX512F__) && defined(__AVX512BW__)) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define FP16_FACTOR 1.0f /* _mm512_cvtph_ps / _mm256_cvtph_ps convert fp16 exactly */
#else
#define FP16_FACTOR 0x1p112f
#endif

static inline float bits_float(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float half_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 31u, m = h & 0x3FFu;
    if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));  /* inf, nan */
    if (e == 0) {
        if (m == 0) return bits_float(sign);
        e = 113;  /* m * 2^-24 = 1.f * 2^(-14 - shifts): float32 exponent field 127 - 14 - shifts */
        while (!(m & 0x400u)) { m <<= 1; e--; }
        return bits_float(sign | (e << 23) | ((m & 0x3FFu) << 13));
    }
    return bits_float(sign | ((e + 112) << 23) | (m << 13));
}

/* out[b] = the float32 of scale `at + b` for b < count: bf16 / fp16 bits converted exactly (fp16's subnormals
   normalized by shifts: integer operations only, which no flush-to-zero mode changes); one loop per kind */
static void scales_row(int scale_kind, const void *table, int64_t at, int64_t count, float *restrict out) {
    const uint8_t *p = (const uint8_t *)table + 2 * at;
    uint16_t h;
    if (scale_kind == 1)
        for (int64_t b = 0; b < count; b++) { memcpy(&h, p + 2 * b, 2); out[b] = bits_float((uint32_t)h << 16); }
    else
        for (int64_t b = 0; b < count; b++) { memcpy(&h, p + 2 * b, 2); out[b] = half_float(h); }
}

/* out[b] = the zero point z + offset of row block r, column block b < KB (see the header) */
static void zeros_row(int zero_kind, const void *zero, int zero_bits, int64_t r, int64_t KB, float offset,
                      float *restrict out) {
    if (zero_kind == 1) {
        const int8_t *z = (const int8_t *)zero + r * KB;
        for (int64_t b = 0; b < KB; b++) out[b] = (float)z[b] + offset;
        return;
    }
    int64_t per = 32 / zero_bits, shift = (r % per) * zero_bits;
    const uint8_t *words = (const uint8_t *)zero + 4 * (r / per) * KB;
    uint32_t mask = (1u << zero_bits) - 1u;
    int32_t half = 1 << (zero_bits - 1), word;
    for (int64_t b = 0; b < KB; b++) {
        memcpy(&word, words + 4 * b, 4);
        out[b] = (float)((int32_t)(((uint32_t)word >> shift) & mask) - half) + offset;
    }
}

static inline float decode(int kind, const uint8_t *w, int64_t k) {
    switch (kind) {
    case 0: { uint16_t h; memcpy(&h, w + 2 * k, 2); return bits_float((uint32_t)h << 16); }
    case 1: { uint16_t h; memcpy(&h, w + 2 * k, 2);
              return bits_float(((uint32_t)(h & 0x7FFFu) << 13) | ((uint32_t)(h & 0x8000u) << 16)); }
    case 2: return (float)(int8_t)w[k];
    case 3: return (float)w[k];
    case 6: { float f; memcpy(&f, w + 4 * k, 4); return f; }
    default: { uint32_t b = w[k]; return bits_float(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)); }
    }
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
/* AVX-512: 16 weights decoded from their bytes to float32 in one register (fp16 exactly: no 2^-112 factor) */
static inline __m512 decode16(int kind, const uint8_t *w, int64_t k) {
    switch (kind) {
    case 0: return _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(w + 2 * k))), 16));
    case 1: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 2 * k)));
    case 2: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
    case 3: return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + k))));
    case 6: return _mm512_loadu_ps((const float *)(w + 4 * k));
    default: {  /* sign-extended, the magnitude's 7 bits moved to 20..26 and the sign (every bit from 7 on) to 31 */
        __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + k)));
        return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32((int)0x87F00000u)));
    }
    }
}

/* Up to MC_MAX activation rows share each weight row's decode: each 16 weights are decoded once and multiplied into
   every row's accumulators. Each row keeps 4 independent accumulator chains within a block (the multiply-adds of one
   chain wait on each other; four keep the vector units busy at one row), summed into the row's total once per block,
   times the block's scale. `kind` and `mc` are constants in each instance (the switch in `rows` inlines one per
   case), so the accumulators live in registers. */
/* 16 bytes of packed pairs at byte j, decoded once: their low nibbles meet each row's xe, the high ones its xo, into
   that row's chains `chain` (low) and `chain + 1` (high) */
static inline __attribute__((always_inline)) void pairs16(int mc, const float *halves, int64_t K, const uint8_t *w,
                                                          int64_t j, __m512 a[][4], int chain) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + j)));
    __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    for (int m = 0; m < mc; m++) {
        const float *xe = halves + m * K, *xo = xe + K / 2;
        a[m][chain] = _mm512_fmadd_ps(_mm512_loadu_ps(xe + j), lo, a[m][chain]);
        a[m][chain + 1] = _mm512_fmadd_ps(_mm512_loadu_ps(xo + j), hi, a[m][chain + 1]);
    }
}

static inline __attribute__((always_inline)) void rows_mc(
        int kind, int mc, int64_t K, const float *x, const float *halves, const uint8_t *w, int64_t size,
        const float *s_row, const float *z_row, float offset, int shifted, const float *sums, int64_t KB,
        float *out) {
    __m512 tot[MC_MAX];
    float rest[MC_MAX];
    for (int m = 0; m < mc; m++) { tot[m] = _mm512_setzero_ps(); rest[m] = 0.0f; }
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += size, b++) {
        int64_t k1 = k0 + size < K ? k0 + size : K;
        __m512 a[MC_MAX][4];
        float tail[MC_MAX];
        for (int m = 0; m < mc; m++) {
            a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm512_setzero_ps();
            tail[m] = 0.0f;
        }
        if (kind == 4) {  /* packed pairs: byte j meets xe[j] (low nibble) and xo[j] (high); see `halves` */
            int64_t j = k0 / 2, j1 = k1 / 2;
            for (; j + 32 <= j1; j += 32) {  /* two 16-byte runs into separate chains */
                pairs16(mc, halves, K, w, j, a, 0);
                pairs16(mc, halves, K, w, j + 16, a, 2);
            }
            for (; j + 16 <= j1; j += 16) pairs16(mc, halves, K, w, j, a, 0);
            for (; j < j1; j++)
                for (int m = 0; m < mc; m++)
                    tail[m] += halves[m * K + j] * (float)(w[j] & 15) + halves[m * K + K / 2 + j] * (float)(w[j] >> 4);
        } else {
            int64_t k = k0;
            for (; k + 64 <= k1; k += 64) {
                __m512 d0 = decode16(kind, w, k), d1 = decode16(kind, w, k + 16);
                __m512 d2 = decode16(kind, w, k + 32), d3 = decode16(kind, w, k + 48);
                for (int m = 0; m < mc; m++) {
                    const float *xm = x + m * K;
                    a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k), d0, a[m][0]);
                    a[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k + 16), d1, a[m][1]);
                    a[m][2] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k + 32), d2, a[m][2]);
                    a[m][3] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + k + 48), d3, a[m][3]);
                }
            }
            for (; k + 16 <= k1; k += 16) {
                __m512 d0 = decode16(kind, w, k);
                for (int m = 0; m < mc; m++) a[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k), d0, a[m][0]);
            }
            for (; k < k1; k++) {  /* fp16 bits decode scaled by 2^-112; this path's outputs are not scaled back */
                float d = kind == 1 ? decode(kind, w, k) * 0x1p112f : decode(kind, w, k);
                for (int m = 0; m < mc; m++) tail[m] += x[m * K + k] * d;
            }
        }
        float s = s_row ? s_row[b] : 1.0f;
        for (int m = 0; m < mc; m++) {
            __m512 sum = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
            tot[m] = _mm512_fmadd_ps(_mm512_set1_ps(s), sum, tot[m]);
            rest[m] += s * tail[m];
            if (shifted) rest[m] -= s * (z_row ? z_row[b] : offset) * sums[m * KB + b];
        }
    }
    for (int m = 0; m < mc; m++) out[m] = rest[m] + _mm512_reduce_add_ps(tot[m]);
}

#define VECTOR_ROWS 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
/* AVX2 (with FMA and F16C; AMD's Zen 3, Intel before AVX-512): the AVX-512 loops' plan at 8 lanes. 8 weights decoded
   from their bytes to float32 in one register (each a widening load and at most two bit operations or a conversion;
   fp16 exactly by F16C) */
static inline __m256 decode8(int kind, const uint8_t *w, int64_t k) {
    switch (kind) {
    case 0: return _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w + 2 * k))), 16));
    case 1: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(w + 2 * k)));
    case 2: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
    case 3: return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + k))));
    case 6: return _mm256_loadu_ps((const float *)(w + 4 * k));
    default: {  /* as decode16 */
        __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + k)));
        return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32((int)0x87F00000u)));
    }
    }
}

/* 8 bytes of packed pairs at byte j, decoded once: low nibbles into each row's chain `lo` (with xe), high into `hi`
   (with xo) */
static inline __attribute__((always_inline)) void pairs8(int mc, const float *halves, int64_t K, const uint8_t *w,
                                                         int64_t j, __m256 a[][4], int lo, int hi) {
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + j)));
    __m256 l = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    __m256 h = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    for (int m = 0; m < mc; m++) {
        const float *xe = halves + m * K, *xo = xe + K / 2;
        a[m][lo] = _mm256_fmadd_ps(_mm256_loadu_ps(xe + j), l, a[m][lo]);
        a[m][hi] = _mm256_fmadd_ps(_mm256_loadu_ps(xo + j), h, a[m][hi]);
    }
}

static inline float sum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* As the AVX-512 rows_mc, with 16 registers: 4 chains per activation row at one or two rows, 2 at three or four (the
   accumulators, the decoded weights and a loaded activation then still fit) */
static inline __attribute__((always_inline)) void rows_mc(
        int kind, int mc, int64_t K, const float *x, const float *halves, const uint8_t *w, int64_t size,
        const float *s_row, const float *z_row, float offset, int shifted, const float *sums, int64_t KB,
        float *out) {
    const int c1 = mc <= 2 ? 1 : 0, c2 = mc <= 2 ? 2 : 1, c3 = mc <= 2 ? 3 : 1;  /* chains 1, 2, 3 or 0, 1, 1 */
    __m256 tot[MC_MAX];
    float rest[MC_MAX];
    for (int m = 0; m < mc; m++) { tot[m] = _mm256_setzero_ps(); rest[m] = 0.0f; }
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += size, b++) {
        int64_t k1 = k0 + size < K ? k0 + size : K;
        __m256 a[MC_MAX][4];
        float tail[MC_MAX];
        for (int m = 0; m < mc; m++) {
            a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm256_setzero_ps();
            tail[m] = 0.0f;
        }
        if (kind == 4) {
            int64_t j = k0 / 2, j1 = k1 / 2;
            for (; j + 16 <= j1; j += 16) {
                pairs8(mc, halves, K, w, j, a, 0, c1);
                pairs8(mc, halves, K, w, j + 8, a, c2, c3);
            }
            for (; j + 8 <= j1; j += 8) pairs8(mc, halves, K, w, j, a, 0, c1);
            for (; j < j1; j++)
                for (int m = 0; m < mc; m++)
                    tail[m] += halves[m * K + j] * (float)(w[j] & 15) + halves[m * K + K / 2 + j] * (float)(w[j] >> 4);
        } else {
            int64_t k = k0;
            for (; k + 32 <= k1; k += 32) {
                __m256 d0 = decode8(kind, w, k), d1 = decode8(kind, w, k + 8);
                __m256 d2 = decode8(kind, w, k + 16), d3 = decode8(kind, w, k + 24);
                for (int m = 0; m < mc; m++) {
                    const float *xm = x + m * K;
                    a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), d0, a[m][0]);
                    a[m][c1] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), d1, a[m][c1]);
                    a[m][c2] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 16), d2, a[m][c2]);
                    a[m][c3] = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 24), d3, a[m][c3]);
                }
            }
            for (; k + 8 <= k1; k += 8) {
                __m256 d0 = decode8(kind, w, k);
                for (int m = 0; m < mc; m++) a[m][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), d0, a[m][0]);
            }
            for (; k < k1; k++) {  /* fp16 bits decode scaled by 2^-112; this path's outputs are not scaled back */
                float d = kind == 1 ? decode(kind, w, k) * 0x1p112f : decode(kind, w, k);
                for (int m = 0; m < mc; m++) tail[m] += x[m * K + k] * d;
            }
        }
        float s = s_row ? s_row[b] : 1.0f;
        for (int m = 0; m < mc; m++) {
            __m256 sum = _mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3]));
            tot[m] = _mm256_fmadd_ps(_mm256_set1_ps(s), sum, tot[m]);
            rest[m] += s * tail[m];
            if (shifted) rest[m] -= s * (z_row ? z_row[b] : offset) * sums[m * KB + b];
        }
    }
    for (int m = 0; m < mc; m++) out[m] = rest[m] + sum8(tot[m]);
}

/* Integer weights (kinds 2, 3, 4) times bf16 activations: `vpmaddwd` multiplies 16 words by 16 words and adds pairs
   into 8 int32 lanes, 4x the weights per instruction of the float32 multiply-adds and half their activation bytes.
   So each run of `unit` activations (the scale block's width, at most UNIT_MAX) is made int16 once per call
   (`x16_activations`): scaled by the power of two 2^(15 - e) that puts its largest |x| below 2^15 and rounded to
   the nearest integer. Each value is then off by at most 2^(e - 16) (2^(e - 15) where it saturates at 32767), under
   2^-14 of the run's largest |x|: a bf16 activation's own rounding is 2^-9 of itself. The integer products and their
   sums within a run are exact; each run's int32 sums become float32 once, times the run's 2^(e - 15) and the block's
   scale. The zero points and offset come off with the sums of the int16 values times their scales (`sums`), as in
   the float32 loops. Per lane a run adds at most UNIT_MAX / 8 products of |w| <= 255 and |x| <= 2^15: under 2^31. */
#define X16 1
#define UNIT_MAX 128

/* The run length the int16 path takes for this layer, or 0 (the float32 loops): whole runs of 32 values in each
   scale block and in K */
static int64_t x16_unit(int kind, int64_t K, int64_t size) {
    int64_t unit = size < UNIT_MAX ? size : UNIT_MAX;
    if (kind < 2 || kind > 4 || unit % 32 != 0 || size % unit != 0 || K % unit != 0) return 0;
    return unit;
}

/* 8 int32 lanes each run's values (for kind 4: the even entries of a and b, or the odd ones), in order */
static inline __m256i x16_pick(__m256i a, __m256i b, int odd) {
    __m256 p = odd ? _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0xDD)
                   : _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);
    return _mm256_permute4x64_epi64(_mm256_castps_si256(p), 0xD8);
}

/* 16 int32 lanes (a, then b) as 16 words in order, saturated to int16 */
static inline __m256i x16_words(__m256i a, __m256i b) {
    return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

/* xq = x's runs as int16 (kind 4: each 32 values as their 16 even then 16 odd entries, the order a 16-byte run of
   pairs decodes in), xs[m * (K / unit) + u] = run u's 2^(e - 15); `sums` (where shifted) the blocks' sums of the
   int16 values times their run's scale. Returns 0 (the float32 loops then run, reading none of it) where some |x| is
   not below 2^100 (inf, NaN) or a run's largest |x| is not 0 and below 2^-100. Rounds to nearest, ties to even (the
   default rounding mode). */
static int x16_activations(int kind, int64_t M, int64_t K, int64_t unit, int64_t size, const float *x, int16_t *xq,
                           float *xs, int shifted, float *sums, int64_t KB) {
    const int64_t KU = K / unit;
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)), huge = _mm256_set1_ps(0x1p100f);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t u = 0; u < KU; u++) {
            const float *xu = x + m * K + u * unit;
            int16_t *qu = xq + m * K + u * unit;
            __m256 top = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
            for (int64_t i = 0; i < unit; i += 8) {
                __m256 v = _mm256_and_ps(_mm256_loadu_ps(xu + i), magnitude);
                top = _mm256_max_ps(top, v);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, huge, _CMP_NLT_UQ));  /* NaN, or 2^100 and up */
            }
            if (_mm256_movemask_ps(bad)) return 0;
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            float amax = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            if (amax != 0.0f && amax < 0x1p-100f) return 0;  /* its scales would leave float32's range */
            int e = 0;
            frexpf(amax, &e);  /* amax < 2^e (e 0 where amax is 0) */
            const __m256 up = _mm256_set1_ps(ldexpf(1.0f, 15 - e));
            __m256i total = _mm256_setzero_si256();
            for (int64_t i = 0; i < unit; i += 32) {
                __m256i q[4], w0, w1;
                for (int j = 0; j < 4; j++)
                    q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xu + i + 8 * j), up));
                if (kind == 4) {
                    w0 = x16_words(x16_pick(q[0], q[1], 0), x16_pick(q[2], q[3], 0));
                    w1 = x16_words(x16_pick(q[0], q[1], 1), x16_pick(q[2], q[3], 1));
                } else {
                    w0 = x16_words(q[0], q[1]);
                    w1 = x16_words(q[2], q[3]);
                }
                _mm256_storeu_si256((__m256i *)(qu + i), w0);
                _mm256_storeu_si256((__m256i *)(qu + i + 16), w1);
                total = _mm256_add_epi32(total,
                                         _mm256_add_epi32(_mm256_madd_epi16(w0, ones), _mm256_madd_epi16(w1, ones)));
            }
            xs[m * KU + u] = ldexpf(1.0f, e - 15);
            if (shifted) {
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
                int64_t b = u * unit / size;
                if (u * unit % size == 0) sums[m * KB + b] = 0.0f;
                sums[m * KB + b] += (float)_mm_cvtsi128_si32(h) * xs[m * KU + u];
            }
        }
    return 1;
}

/* sum over blocks b < KB of s[b] * (z[b], or `offset` where z is NULL) * sums[b], 8 blocks per step */
static float x16_shift(int64_t KB, const float *s, const float *z, float offset, const float *sums) {
    __m256 acc = _mm256_setzero_ps();
    float rest = 0.0f;
    int64_t b = 0;
    for (; b + 8 <= KB; b += 8) {
        __m256 zb = z ? _mm256_loadu_ps(z + b) : _mm256_set1_ps(offset);
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_loadu_ps(s + b), zb), _mm256_loadu_ps(sums + b), acc);
    }
    for (; b < KB; b++) rest += s[b] * (z ? z[b] : offset) * sums[b];
    return rest + sum8(acc);
}

/* As rows_mc, from the int16 runs: 32 weights per step widened to words once for all rows (kind 4: a 16-byte run
   of pairs, its low nibbles meeting the run's first 16 words, the high its next 16) */
static inline __attribute__((always_inline)) void x16_rows_mc(
        int kind, int mc, int64_t K, int64_t unit, const int16_t *xq, const float *xs, const uint8_t *w,
        int64_t size, const float *s_row, const float *z_row, float offset, int shifted, const float *sums,
        int64_t KB, float *out) {
    const int64_t KU = K / unit, per_block = size / unit, step = kind == 4 ? unit / 2 : unit;  /* (bytes per run) */
    __m256 tot[MC_MAX];
    for (int m = 0; m < mc; m++) tot[m] = _mm256_setzero_ps();
    float s = s_row ? s_row[0] : 1.0f;
    for (int64_t u = 0, b = 0, in_block = 0; u < KU; u++, w += step) {  /* one flat loop over the runs */
        __m256i a[MC_MAX][2];
        for (int m = 0; m < mc; m++) a[m][0] = a[m][1] = _mm256_setzero_si256();
        for (int64_t k = 0; k < unit; k += 32) {
            __m256i w0, w1;
            if (kind == 4) {
                __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + (k >> 1))));
                w0 = _mm256_and_si256(bytes, _mm256_set1_epi16(15));
                w1 = _mm256_srli_epi16(bytes, 4);
            } else if (kind == 2) {
                w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
                w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16)));
            } else {
                w0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + k)));
                w1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(w + k + 16)));
            }
            for (int m = 0; m < mc; m++) {
                const int16_t *xm = xq + m * K + u * unit + k;
                a[m][0] = _mm256_add_epi32(a[m][0], _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xm)));
                a[m][1] = _mm256_add_epi32(a[m][1],
                                           _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xm + 16))));
            }
        }
        for (int m = 0; m < mc; m++)
            tot[m] = _mm256_fmadd_ps(_mm256_set1_ps(s * xs[m * KU + u]),
                                     _mm256_cvtepi32_ps(_mm256_add_epi32(a[m][0], a[m][1])), tot[m]);
        if (++in_block == per_block && u + 1 < KU) { in_block = 0; b++; s = s_row ? s_row[b] : 1.0f; }
    }
    for (int m = 0; m < mc; m++)
        out[m] = sum8(tot[m]) - (shifted ? x16_shift(KB, s_row, z_row, offset, sums + m * KB) : 0.0f);
}

#define X16_CASE(KIND)                                                                                          \
    switch (mc) {                                                                                               \
    case 1: x16_rows_mc(KIND, 1, K, unit, xq, xs, w, size, s_row, z_row, offset, shifted, sums, KB, out); return; \
    case 2: x16_rows_mc(KIND, 2, K, unit, xq, xs, w, size, s_row, z_row, offset, shifted, sums, KB, out); return; \
    case 3: x16_rows_mc(KIND, 3, K, unit, xq, xs, w, size, s_row, z_row, offset, shifted, sums, KB, out); return; \
    default: x16_rows_mc(KIND, 4, K, unit, xq, xs, w, size, s_row, z_row, offset, shifted, sums, KB, out); return; \
    }

static void x16_rows(int kind, int mc, int64_t K, int64_t unit, const int16_t *xq, const float *xs,
                     const uint8_t *w, int64_t size, const float *s_row, const float *z_row, float offset,
                     int shifted, const float *sums, int64_t KB, float *out) {
    if (kind == 2) X16_CASE(2)
    if (kind == 3) X16_CASE(3)
    X16_CASE(4)
}
#define VECTOR_ROWS 1
#endif

#ifdef VECTOR_ROWS
#define ROWS_CASE(KIND)                                                                                         \
    switch (mc) {                                                                                               \
    case 1: rows_mc(KIND, 1, K, x, halves, w, size, s_row, z_row, offset, shifted, sums, KB, out); return;      \
    case 2: rows_mc(KIND, 2, K, x, halves, w, size, s_row, z_row, offset, shifted, sums, KB, out); return;      \
    case 3: rows_mc(KIND, 3, K, x, halves, w, size, s_row, z_row, offset, shifted, sums, KB, out); return;      \
    default: rows_mc(KIND, 4, K, x, halves, w, size, s_row, z_row, offset, shifted, sums, KB, out); return;     \
    }

/* out[m] for m < mc <= MC_MAX: activation rows x (and their `halves`, `sums`) times weight row w, unscaled by the
   fp16 / FP8 factor */
static void rows(int kind, int mc, int64_t K, const float *x, const float *halves, const uint8_t *w, int64_t size,
                 const float *s_row, const float *z_row, float offset, int shifted, const float *sums, int64_t KB,
                 float *out) {
    switch (kind) {
    case 0: ROWS_CASE(0)
    case 1: ROWS_CASE(1)
    case 2: ROWS_CASE(2)
    case 3: ROWS_CASE(3)
    case 4: ROWS_CASE(4)
    case 6: ROWS_CASE(6)
    default: ROWS_CASE(5)
    }
}

#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && (defined(__AVX512BF16__) || defined(__AVX512VNNI__))
/* What comes off a row's integer products (see the header): its blocks' zero points `z_row` (NULL: `offset` for
   every block), a path's `bias` per value, times the activation rows' block sums `sums` (KB per row) */
struct shift {
    const float *z_row;
    float offset, bias;
    const float *sums;
    int64_t KB;
};

/* s[b] * (z[b] + bias) * sums[b] over b < KB (z NULL: `offset` for every block), summed into 16 lanes, 16 blocks
   per step: the bf16 dot products' and the VNNI runs' zero points. Unreduced, so a row's products take it off their
   own lanes before their one sum across the lanes (a second sum had cost an int4 row of 1 KiB an eighth of its
   time). */
static inline __m512 shift_lanes(int64_t KB, const float *s, const float *z, float offset, float bias,
                                 const float *sums) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < KB; b += 16) {
        __mmask16 live = KB - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (KB - b)) - 1u);
        __m512 zb = z ? _mm512_maskz_loadu_ps(live, z + b) : _mm512_set1_ps(offset);
        __m512 terms = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + b), _mm512_add_ps(zb, _mm512_set1_ps(bias)));
        acc = _mm512_fmadd_ps(terms, _mm512_maskz_loadu_ps(live, sums + b), acc);
    }
    return acc;
}

#ifdef __AVX512BF16__
static float shift_sum(int64_t KB, const float *s, const float *z, float offset, float bias, const float *sums) {
    return _mm512_reduce_add_ps(shift_lanes(KB, s, z, offset, bias, sums));
}
#endif
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
/* Activations that are bf16 values (a bf16 model's): each product of bf16 weights, or of int4 values made bf16, is
   exact in float32, so AVX512-BF16's `vdpbf16ps` (32 weights per instruction, summed in float32) gives the float32
   loop's sums with no decode to float32 at all. bf16 weights are multiplied as stored. An int4 nibble q becomes the
   bf16 word of q - 8 by two byte lookups (its low and high bytes, `INT4_*_BYTES`), so a 64-byte run of weights (128
   values, one group of 128) is an AND, a shift, four lookups and four byte interleaves; the -8 each value carries is
   taken off with the zero point (`BF16_INT4_BIAS`), as the offset is. (Placing q under the byte 0x43, the word of
   128 + q, spares the lookups and ran 5-9% faster, but its sums carry 128 per value: 10-30x the rounding error of
   the float32 loop, where q - 8 has less than it.) The interleaves work per 128-bit lane, so `bf16_activations`
   lays x out once per call in the order the words come. On the 2-core Xeon, `vdpbf16ps` issues once per ~2 cycles:
   four per run are the bound in cache. */
#define BF16_INT4_BIAS (-8.0f)
/* the bf16 word of q - 8 for q = 0..15, its low and high bytes */
static const uint8_t INT4_LOW_BYTES[16] = {0x00, 0xE0, 0xC0, 0xA0, 0x80, 0x40, 0x00, 0x80, 0x00, 0x80, 0x00, 0x40,
                                           0x80, 0xA0, 0xC0, 0xE0};
static const uint8_t INT4_HIGH_BYTES[16] = {0xC1, 0xC0, 0xC0, 0xC0, 0xC0, 0xC0, 0xC0, 0xBF, 0x00, 0x3F, 0x40, 0x40,
                                            0x40, 0x40, 0x40, 0x40};
#define BF16_DOT 1

/* xb = x's bf16 bits (the values are bf16: truncation is exact), for kind 4 in each 64-byte run's word order: the
   run's interleaves give words for bytes 16L + (0..7) (low nibbles), 16L + (8..15) (low), then the same for the high
   nibbles, per lane L = 0..3; byte j's low nibble is k = 2j, its high nibble 2j + 1 */
static void bf16_activations(int kind, int64_t M, int64_t K, const float *x, uint16_t *xb) {
    for (int64_t m = 0; m < M; m++) {
        const uint32_t *xm = (const uint32_t *)(x + m * K);
        uint16_t *out = xb + m * K;
        if (kind != 4) {
            for (int64_t k = 0; k < K; k++) out[k] = (uint16_t)(xm[k] >> 16);
            continue;
        }
        for (int64_t k0 = 0; k0 < K; k0 += 128, out += 128)
            for (int part = 0; part < 4; part++)  /* low nibbles' first, second halves; high nibbles' */
                for (int i = 0; i < 32; i++) {
                    int64_t byte = k0 / 2 + 16 * (i / 8) + 8 * (part & 1) + i % 8;
                    out[32 * part + i] = (uint16_t)(xm[2 * byte + (part >> 1)] >> 16);
                }
    }
}

static inline __attribute__((always_inline)) __m512bh as_bh(__m512i v) { return (__m512bh)v; }

/* out[m] = sum over blocks b of s_b * (sum_k x[m, k] w[k]) for activation rows m < mc (their bf16 `xb`) and a
   bf16 weight row; each row keeps 2 chains per block, which meet the block's scale in one multiply-add */
static inline __attribute__((always_inline)) void dot_bf16_mc(int mc, int64_t K, const uint16_t *xb,
                                                              const uint16_t *w, int64_t size, const float *s_row,
                                                              float *out) {
    __m512 tot[MC_MAX];
    float rest[MC_MAX];
    for (int m = 0; m < mc; m++) { tot[m] = _mm512_setzero_ps(); rest[m] = 0.0f; }
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += size, b++) {
        int64_t k1 = k0 + size < K ? k0 + size : K, k = k0;
        __m512 a[MC_MAX][2];
        float tail[MC_MAX];
        for (int m = 0; m < mc; m++) { a[m][0] = a[m][1] = _mm512_setzero_ps(); tail[m] = 0.0f; }
        for (; k + 64 <= k1; k += 64) {
            __m512i w0 = _mm512_loadu_si512(w + k), w1 = _mm512_loadu_si512(w + k + 32);
            for (int m = 0; m < mc; m++) {
                const uint16_t *xm = xb + m * K + k;
                a[m][0] = _mm512_dpbf16_ps(a[m][0], as_bh(_mm512_loadu_si512(xm)), as_bh(w0));
                a[m][1] = _mm512_dpbf16_ps(a[m][1], as_bh(_mm512_loadu_si512(xm + 32)), as_bh(w1));
            }
        }
        for (; k + 32 <= k1; k += 32) {
            __m512i w0 = _mm512_loadu_si512(w + k);
            for (int m = 0; m < mc; m++)
                a[m][0] = _mm512_dpbf16_ps(a[m][0], as_bh(_mm512_loadu_si512(xb + m * K + k)), as_bh(w0));
        }
        for (; k < k1; k++)
            for (int m = 0; m < mc; m++)
                tail[m] += bits_float((uint32_t)xb[m * K + k] << 16) * bits_float((uint32_t)w[k] << 16);
        float s = s_row ? s_row[b] : 1.0f;
        for (int m = 0; m < mc; m++) {
            tot[m] = _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_add_ps(a[m][0], a[m][1]), tot[m]);
            rest[m] += s * tail[m];
        }
    }
    for (int m = 0; m < mc; m++) out[m] = rest[m] + _mm512_reduce_add_ps(tot[m]);
}

/* The same for an int4 row (words q - 8, looked up) whose blocks are whole runs of 128 values: one flat loop over
   the runs, each run's four products summed in two chains and multiplied into the row's total by its block's scale,
   so a run costs a load, three bit operations, four lookups, four interleaves, four products, an add and a
   multiply-add */
static inline __attribute__((always_inline)) void dot_int4_mc(int mc, int64_t K, const uint16_t *xb,
                                                              const uint8_t *w, int64_t size, const float *s_row,
                                                              float *out) {
    __m512 tot[MC_MAX];
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i lb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)INT4_LOW_BYTES));
    const __m512i hb = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)INT4_HIGH_BYTES));
    const int64_t per_block = size / 128;
    for (int m = 0; m < mc; m++) tot[m] = _mm512_setzero_ps();
    for (int64_t k = 0, b = 0, in_block = 0; k < K; k += 128) {
        __m512i bytes = _mm512_loadu_si512(w + k / 2);
        __m512i lo = _mm512_and_si512(bytes, low), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
        __m512i lo_l = _mm512_shuffle_epi8(lb, lo), lo_h = _mm512_shuffle_epi8(hb, lo);
        __m512i hi_l = _mm512_shuffle_epi8(lb, hi), hi_h = _mm512_shuffle_epi8(hb, hi);
        __m512i w0 = _mm512_unpacklo_epi8(lo_l, lo_h), w1 = _mm512_unpackhi_epi8(lo_l, lo_h);
        __m512i w2 = _mm512_unpacklo_epi8(hi_l, hi_h), w3 = _mm512_unpackhi_epi8(hi_l, hi_h);
        __m512 s = _mm512_set1_ps(s_row[b]);
        for (int m = 0; m < mc; m++) {
            const uint16_t *xm = xb + m * K + k;
            __m512 a0 = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(_mm512_loadu_si512(xm)), as_bh(w0));
            __m512 a1 = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(_mm512_loadu_si512(xm + 32)), as_bh(w1));
            a0 = _mm512_dpbf16_ps(a0, as_bh(_mm512_loadu_si512(xm + 64)), as_bh(w2));
            a1 = _mm512_dpbf16_ps(a1, as_bh(_mm512_loadu_si512(xm + 96)), as_bh(w3));
            tot[m] = _mm512_fmadd_ps(s, _mm512_add_ps(a0, a1), tot[m]);
        }
        if (++in_block == per_block) { in_block = 0; b++; }
    }
    for (int m = 0; m < mc; m++) out[m] = _mm512_reduce_add_ps(tot[m]);
}

#define DOT_CASE(FN, W)                                                                                  \
    switch (mc) {                                                                                        \
    case 1: FN(1, K, xb, W, size, s_row, out); return;                                                   \
    case 2: FN(2, K, xb, W, size, s_row, out); return;                                                   \
    case 3: FN(3, K, xb, W, size, s_row, out); return;                                                   \
    default: FN(4, K, xb, W, size, s_row, out); return;                                                  \
    }

/* An FP8 subnormal's bf16 word, per 16-bit lane of `v` (32 FP8 bytes sign-extended): the word of its signed
   mantissa (+-1..7, by a lookup of sign and mantissa), 0 in a lane whose byte is not a subnormal (or is +-0) */
static const uint16_t SUBNORMAL_WORDS[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
                                             0x8000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0A0, 0xC0C0, 0xC0E0};
static inline __attribute__((always_inline)) __m512i subnormal_words(__m512i v) {
    __mmask32 exponent0 = _mm512_testn_epi16_mask(v, _mm512_set1_epi16(0x78));
    __m512i index = _mm512_or_si512(_mm512_and_si512(v, _mm512_set1_epi16(7)),
                                    _mm512_and_si512(_mm512_srli_epi16(v, 12), _mm512_set1_epi16(8)));
    return _mm512_maskz_permutexvar_epi16(exponent0, index, _mm512_loadu_si512(SUBNORMAL_WORDS));
}

/* The same for an FP8 (e4m3fn) row, each byte made the bf16 word of its value times 2^-120 (as the float32 loops place
   it): sign-extended to 16 bits, shifted left 4 (the sign lands at 15, the magnitude's 7 bits at 4..10), the bits in
   between cleared. An FP8 subnormal (exponent 0, mantissa not 0) becomes a bf16 denormal, which the dot product reads
   as 0. From the first 64-byte run of a block that holds one (two byte tests per run; rare where a checkpoint is
   scaled to FP8's range), every run takes a second dot product of x with its subnormals as the words of their
   signed mantissas (`subnormal_words`: normal bf16 values, exact products; the subnormal is that times 2^-9, placed
   at 2^-129), the block's sum of them placed once. (They were added one by one where a run held one: with 1% of the
   weights subnormal, as unscaled `randn` gives, half the runs held one, the branch went either way, and the row
   read 4.8 GB/s against 26. Testing a whole block before its products cost the usual rows a quarter of their
   rate.) The runs of 64 values from `k`, with the subnormals' dot product (`with_subnormals`, a constant in each
   instance), or without it until a run holding one: returns where it stopped (`k1`: the block's runs done). */
static inline __attribute__((always_inline)) int64_t fp8_runs(int mc, int with_subnormals, int64_t K,
                                                              const uint16_t *xb, const uint8_t *w, int64_t k,
                                                              int64_t k1, __m512 a[][2], __m512 *c) {
    const __m512i keep = _mm512_set1_epi16((short)0x87F0);
    const __m512i exponent = _mm512_set1_epi8(0x78), mantissa = _mm512_set1_epi8(0x07);
    for (; k < k1; k += 64) {
        __m512i bytes = _mm512_loadu_si512(w + k);
        if (!with_subnormals && _mm512_mask_test_epi8_mask(_mm512_testn_epi8_mask(bytes, exponent), bytes, mantissa))
            return k;
        __m512i v0 = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(bytes));
        __m512i v1 = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(bytes, 1));
        __m512i w0 = _mm512_and_si512(_mm512_slli_epi16(v0, 4), keep);
        __m512i w1 = _mm512_and_si512(_mm512_slli_epi16(v1, 4), keep);
        for (int m = 0; m < mc; m++) {
            const uint16_t *xm = xb + m * K + k;
            a[m][0] = _mm512_dpbf16_ps(a[m][0], as_bh(_mm512_loadu_si512(xm)), as_bh(w0));
            a[m][1] = _mm512_dpbf16_ps(a[m][1], as_bh(_mm512_loadu_si512(xm + 32)), as_bh(w1));
        }
        if (with_subnormals) {
            __m512i s0 = subnormal_words(v0), s1 = subnormal_words(v1);
            for (int m = 0; m < mc; m++) {
                const uint16_t *xm = xb + m * K + k;
                c[m] = _mm512_dpbf16_ps(c[m], as_bh(_mm512_loadu_si512(xm)), as_bh(s0));
                c[m] = _mm512_dpbf16_ps(c[m], as_bh(_mm512_loadu_si512(xm + 32)), as_bh(s1));
            }
        }
    }
    return k1;
}

static inline __attribute__((always_inline)) void dot_fp8_mc(int mc, int64_t K, const uint16_t *xb,
                                                             const uint8_t *w, int64_t size, const float *s_row,
                                                             float *out) {
    __m512 tot[MC_MAX];
    float rest[MC_MAX];
    for (int m = 0; m < mc; m++) { tot[m] = _mm512_setzero_ps(); rest[m] = 0.0f; }
    for (int64_t k0 = 0, b = 0; k0 < K; k0 += size, b++) {
        int64_t k1 = k0 + size < K ? k0 + size : K, runs = k0 + (k1 - k0) / 64 * 64;
        __m512 a[MC_MAX][2], c[MC_MAX];
        float tail[MC_MAX], low[MC_MAX];
        for (int m = 0; m < mc; m++) { a[m][0] = a[m][1] = c[m] = _mm512_setzero_ps(); tail[m] = low[m] = 0.0f; }
        int64_t k = fp8_runs(mc, 0, K, xb, w, k0, runs, a, c);
        if (k < runs) {
            fp8_runs(mc, 1, K, xb, w, k, runs, a, c);
            for (int m = 0; m < mc; m++) low[m] = _mm512_reduce_add_ps(c[m]);
        }
        for (k = runs; k < k1; k++)
            for (int m = 0; m < mc; m++) tail[m] += bits_float((uint32_t)xb[m * K + k] << 16) * decode(5, w, k);
        float s = s_row ? s_row[b] : 1.0f;
        for (int m = 0; m < mc; m++) {
            tot[m] = _mm512_fmadd_ps(_mm512_set1_ps(s), _mm512_add_ps(a[m][0], a[m][1]), tot[m]);
            rest[m] += s * tail[m];
            if (low[m] != 0.0f)  /* 2^-129 in two normal factors: a denormal constant would cost an assist, and
                                    reads as 0 where denormals are flushed */
                rest[m] += s * ((low[m] * 0x1p-64f) * 0x1p-65f);
        }
    }
    for (int m = 0; m < mc; m++) out[m] = rest[m] + _mm512_reduce_add_ps(tot[m]);
}

static void dot_bf16(int kind, int mc, int64_t K, const uint16_t *xb, const uint8_t *w, int64_t size,
                     const float *s_row, float *out) {
    if (kind == 4) DOT_CASE(dot_int4_mc, w)
    if (kind == 5) DOT_CASE(dot_fp8_mc, w)
    DOT_CASE(dot_bf16_mc, (const uint16_t *)w)
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* Integer weights (kinds 2, 3, 4) times bf16 activations by AVX512-VNNI's `vpdpbusd`: 64 byte products per
   instruction (unsigned times signed bytes, 4 summed into each int32 lane), so an int4 run needs no widening at all
   and int8 none to words. Each run of I8_RUN activations is made an integer q of 15 bits once per call
   (`i8_activations`): scaled by the power of two 2^(14 - e) that puts its largest |x| below 2^14, rounded to the
   nearest, so each value is off by at most 2^(e - 15) (2^-14 of the run's largest |x|, where a bf16 activation's own
   rounding is 2^-9 of itself), and split into bytes q = 128 h + l (h signed, l in 0..127): the weights, unsigned bytes
   (int4 nibbles 0..15, uint8 words; int8 values with their sign bit flipped, which adds 128 to each and is taken off
   with the zero points, `VNNI_INT8_BIAS`), meet h and l in two products each, exact in int32, summed as 128 h + l
   per run (under 2^31: 8 products of 255 x 128 per lane) and multiplied into float32 by the run's 2^(e - 14) and
   its block's scale. The zero points and offset come off with the sums of the q values times their run's scale
   (`sums`), as in the int16 runs, off each row's lanes before their one sum. One 5632 x 2048 layer at one row on the
   2-core EPYC: int8 weights ran 1.6x faster in cache than by the float32 loops (55 against 34 GB/s; from memory
   31-36 against 25-27), int4 weights 1.2x faster from memory than by the bf16 dot products (32-35 against 28-29
   GB/s), which are exact and remain where the CPU has AVX512-BF16 without VNNI (`TPKIT_NATIVE_ISA=avx512-bf16`). */
#define VNNI_RUNS 1
#define I8_RUN 128
#define VNNI_INT8_BIAS 128.0f

/* Whether a layer's blocks are whole runs: K and the scale blocks' width multiples of I8_RUN */
static int i8_fits(int kind, int64_t K, int64_t size) {
    return kind >= 2 && kind <= 4 && K % I8_RUN == 0 && size % I8_RUN == 0;
}

/* xq = each row's runs as bytes, 2 I8_RUN per run: per 64 values, their 64 h then their 64 l, the 64 values those
   the weights' 64 bytes meet (kind 4: the run's even entries, then its odd ones; else in order); xs[m * KU + u] =
   run u's 2^(e - 14); `sums` (where shifted) the blocks' sums of q times their run's scale. Returns 0 (the caller's
   other paths then run) where some |x| is not below 2^100 (inf, NaN) or a run's largest |x| is not 0 and below
   2^-100. */
static int i8_activations(int kind, int64_t M, int64_t K, int64_t size, const float *x, uint8_t *xq, float *xs,
                          int shifted, float *sums, int64_t KB) {
    const int64_t KU = K / I8_RUN;
    const __m512 huge = _mm512_set1_ps(0x1p100f);
    const __m512i seven = _mm512_set1_epi32(127), top_q = _mm512_set1_epi32(16383);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m512i even = _mm512_sub_epi32(odd, _mm512_set1_epi32(1));
    for (int64_t m = 0; m < M; m++)
        for (int64_t u = 0; u < KU; u++) {
            const float *xu = x + m * K + u * I8_RUN;
            uint8_t *qu = xq + 2 * (m * K + u * I8_RUN);
            __m512 top = _mm512_setzero_ps();
            __mmask16 bad = 0;
            for (int i = 0; i < I8_RUN; i += 16) {
                __m512 v = _mm512_abs_ps(_mm512_loadu_ps(xu + i));
                top = _mm512_max_ps(top, v);
                bad |= _mm512_cmp_ps_mask(v, huge, _CMP_NLT_UQ);  /* NaN, or 2^100 and up */
            }
            if (bad) return 0;
            float amax = _mm512_reduce_max_ps(top);
            if (amax != 0.0f && amax < 0x1p-100f) return 0;  /* its scales would leave float32's range */
            int e = 0;
            frexpf(amax, &e);  /* amax < 2^e (e 0 where amax is 0) */
            const __m512 up = _mm512_set1_ps(ldexpf(1.0f, 14 - e));
            __m512i total = _mm512_setzero_si512();
            for (int c = 0; c < 2; c++)  /* the run's two halves of 64 values, as the weights' bytes meet them */
                for (int i = 0; i < 64; i += 16) {
                    __m512 v;
                    if (kind == 4) {
                        const float *pair = xu + 2 * i;  /* 32 values: 16 even, 16 odd entries */
                        v = _mm512_permutex2var_ps(_mm512_loadu_ps(pair), c ? odd : even, _mm512_loadu_ps(pair + 16));
                    } else {
                        v = _mm512_loadu_ps(xu + 64 * c + i);
                    }
                    __m512i q = _mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v, up)), top_q);
                    total = _mm512_add_epi32(total, q);
                    _mm_storeu_si128((__m128i *)(qu + 128 * c + i), _mm512_cvtepi32_epi8(_mm512_srai_epi32(q, 7)));
                    _mm_storeu_si128((__m128i *)(qu + 128 * c + 64 + i),
                                     _mm512_cvtepi32_epi8(_mm512_and_si512(q, seven)));
                }
            xs[m * KU + u] = ldexpf(1.0f, e - 14);
            if (shifted) {
                int64_t b = u * I8_RUN / size;
                if (u * I8_RUN % size == 0) sums[m * KB + b] = 0.0f;
                sums[m * KB + b] += (float)_mm512_reduce_add_epi32(total) * xs[m * KU + u];
            }
        }
    return 1;
}

/* out[m] = sum over runs of s_b * 2^(e - 14) * (sum of the run's weights times q), for activation rows m < mc: each
   64 weight bytes loaded (and for kind 4 split into nibbles) once for all rows */
static inline __attribute__((always_inline)) void i8_rows_mc(int kind, int mc, int64_t K, const uint8_t *xq,
                                                             const float *xs, const uint8_t *w, int64_t size,
                                                             const float *s_row, const struct shift *shift,
                                                             float *out) {
    const int64_t KU = K / I8_RUN, per_block = size / I8_RUN;
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    __m512 tot[MC_MAX], odd[MC_MAX];  /* even and odd runs' sums: one chain of multiply-adds waited on itself */
    for (int m = 0; m < mc; m++) tot[m] = odd[m] = _mm512_setzero_ps();
    float s = s_row ? s_row[0] : 1.0f;
    for (int64_t u = 0, b = 0, in_block = 0; u < KU; u++) {
        __m512i w0, w1;
        if (kind == 4) {
            __m512i bytes = _mm512_loadu_si512(w);
            w0 = _mm512_and_si512(bytes, low);
            w1 = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low);
            w += 64;
        } else {
            w0 = _mm512_loadu_si512(w);
            w1 = _mm512_loadu_si512(w + 64);
            if (kind == 2) { w0 = _mm512_xor_si512(w0, flip); w1 = _mm512_xor_si512(w1, flip); }
            w += 128;
        }
        for (int m = 0; m < mc; m++) {
            const uint8_t *xm = xq + 2 * (m * K + u * I8_RUN);
            __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xm));
            __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(xm + 64));
            h = _mm512_dpbusd_epi32(h, w1, _mm512_loadu_si512(xm + 128));
            l = _mm512_dpbusd_epi32(l, w1, _mm512_loadu_si512(xm + 192));
            __m512 run = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
            __m512 f = _mm512_set1_ps(s * xs[m * KU + u]);
            if (u & 1) odd[m] = _mm512_fmadd_ps(f, run, odd[m]);
            else tot[m] = _mm512_fmadd_ps(f, run, tot[m]);
        }
        if (++in_block == per_block && u + 1 < KU) { in_block = 0; b++; s = s_row ? s_row[b] : 1.0f; }
    }
    for (int m = 0; m < mc; m++) {
        __m512 sum = _mm512_add_ps(tot[m], odd[m]);
        if (shift)  /* the blocks' zero points and offset (and int8's bias) times the sums of q */
            sum = _mm512_sub_ps(sum, shift_lanes(shift->KB, s_row, shift->z_row, shift->offset, shift->bias,
                                                 shift->sums + m * shift->KB));
        out[m] = _mm512_reduce_add_ps(sum);
    }
}

#define I8_CASE(KIND)                                                                                        \
    switch (mc) {                                                                                            \
    case 1: i8_rows_mc(KIND, 1, K, xq, xs, w, size, s_row, shift, out); return;                              \
    case 2: i8_rows_mc(KIND, 2, K, xq, xs, w, size, s_row, shift, out); return;                              \
    case 3: i8_rows_mc(KIND, 3, K, xq, xs, w, size, s_row, shift, out); return;                              \
    default: i8_rows_mc(KIND, 4, K, xq, xs, w, size, s_row, shift, out); return;                             \
    }

static void i8_rows(int kind, int mc, int64_t K, const uint8_t *xq, const float *xs, const uint8_t *w, int64_t size,
                    const float *s_row, const struct shift *shift, float *out) {
    if (kind == 2) I8_CASE(2)
    if (kind == 3) I8_CASE(3)
    I8_CASE(4)
}
#endif

#ifndef VECTOR_ROWS
/* acc[l] += s * (sum over k in [k0, k1), k = l mod LANES, of x[k] * decode(w, k)), and the returned tail (k past the
   last whole run of LANES) times s: the kind is a constant in each instance (inlined per case) */
#define BLOCK(NAME, KIND)                                                                                   \
    static float NAME(const float *restrict x, const uint8_t *restrict w, int64_t k0, int64_t k1, float s,  \
                      float *restrict acc) {                                                                \
        float part[LANES] = {0};                                                                            \
        int64_t k = k0;                                                                                     \
        for (; k + LANES <= k1; k += LANES)                                                                 \
            for (int l = 0; l < LANES; l++) part[l] += x[k + l] * decode(KIND, w, k + l);                   \
        for (int l = 0; l < LANES; l++) acc[l] += s * part[l];                                              \
        float tail = 0.0f;                                                                                  \
        for (; k < k1; k++) tail += x[k] * decode(KIND, w, k);                                              \
        return s * tail;                                                                                    \
    }
BLOCK(block_bf16, 0)
BLOCK(block_fp16, 1)
BLOCK(block_int8, 2)
BLOCK(block_uint8, 3)
BLOCK(block_fp8, 5)
BLOCK(block_fp32, 6)

/* packed pairs over bytes [j0, j1): xe / xo are x's even / odd entries, so byte j meets xe[j] (low nibble) and
   xo[j] (high) */
static float block_uint4(const float *restrict xe, const float *restrict xo, const uint8_t *restrict w, int64_t j0,
                         int64_t j1, float s, float *restrict acc) {
    float lo[LANES / 2] = {0}, hi[LANES / 2] = {0};
    int64_t j = j0;
    for (; j + LANES / 2 <= j1; j += LANES / 2)
        for (int l = 0; l < LANES / 2; l++) {
            lo[l] += xe[j + l] * (float)(w[j + l] & 15);
            hi[l] += xo[j + l] * (float)(w[j + l] >> 4);
        }
    for (int l = 0; l < LANES / 2; l++) acc[l] += s * (lo[l] + hi[l]);
    float tail = 0.0f;
    for (; j < j1; j++) tail += xe[j] * (float)(w[j] & 15) + xo[j] * (float)(w[j] >> 4);
    return s * tail;
}

static float block(int kind, const float *x, const float *xe, const float *xo, const uint8_t *row, int64_t k0,
                   int64_t k1, float s, float *acc) {
    switch (kind) {
    case 0: return block_bf16(x, row, k0, k1, s, acc);
    case 1: return block_fp16(x, row, k0, k1, s, acc);
    case 2: return block_int8(x, row, k0, k1, s, acc);
    case 3: return block_uint8(x, row, k0, k1, s, acc);
    case 4: return block_uint4(xe, xo, row, k0 / 2, k1 / 2, s, acc);
    case 6: return block_fp32(x, row, k0, k1, s, acc);
    default: return block_fp8(x, row, k0, k1, s, acc);
    }
}

/* out[m] for m < mc: each activation row by itself against weight row w (see the AVX-512 `rows`) */
static void rows(int kind, int mc, int64_t K, const float *x, const float *halves, const uint8_t *w, int64_t size,
                 const float *s_row, const float *z_row, float offset, int shifted, const float *sums, int64_t KB,
                 float *out) {
    for (int m = 0; m < mc; m++) {
        const float *xm = x + m * K;
        const float *xe = halves ? halves + m * K : 0, *xo = halves ? halves + m * K + K / 2 : 0;
        float acc[LANES] = {0}, total = 0.0f;
        for (int64_t k0 = 0, b = 0; k0 < K; k0 += size, b++) {
            float s = s_row ? s_row[b] : 1.0f;
            total += block(kind, xm, xe, xo, w, k0, k0 + size < K ? k0 + size : K, s, acc);
            if (shifted) total -= s * (z_row ? z_row[b] : offset) * sums[m * KB + b];
        }
        for (int l = 0; l < LANES; l++) total += acc[l];
        out[m] = total;
    }
}
#endif

/* The products this build has, for bf16 activations: 1 AVX512-BF16's dot products (BF16_DOT: bf16, FP8 weights, and
   int4 without VNNI), 2 int16 runs of x for integer weights (X16), 4 15-bit runs of x for integer weights by VNNI
   (VNNI_RUNS); 0 the float32 loops only */
int tp_paths(void) {
    int paths = 0;
#ifdef BF16_DOT
    paths |= 1;
#endif
#ifdef X16
    paths |= 2;
#endif
#ifdef VNNI_RUNS
    paths |= 4;
#endif
    return paths;
}

/* The stored bytes of one weight row of `kind` and K columns */
static inline int64_t weight_row_bytes(int kind, int64_t K) {
    return kind == 4 ? K / 2 : kind == 6 ? 4 * K : (kind <= 1 ? 2 * K : K);
}

/* Rows [n0, n1) of y (`[M, N]` float32) for x `[M, K]` float32. `sums`: M x KB scratch (the blocks' sums of x, when
   there are zero points or an offset); `halves`: M x K scratch (x de-interleaved into even / odd k, for kind 4; x
   scaled up, for kind 5 and for kind 1 without F16C);
   `row`: 2 x KB scratch (a row block's scales and zero points as float32, decoded once for all M rows: the inner
   loops then read float32 as they would from a float32 table). `xb`: M x K scratch of 16-bit words where x's values
   are bf16 (a bf16 model's activations), else NULL: bf16, int4 and FP8 weights then take the bf16 dot products
   (int4 where its blocks are whole runs of 128 values, FP8 at one row), the sums of x (`sums`, needed) carrying
   int4's bias; in AVX2 builds, integer weights take x's int16 runs (X16): then M x K words followed by M x K / 32
   float32 (the runs' scales). */
void tp_gemv(int kind, int64_t M, int64_t N, int64_t K, const float *x, const void *w, const void *scale,
             int scale_kind, const void *zero, int zero_kind, int zero_bits, float offset, int64_t bh, int64_t bw,
             int64_t KB, float *y, int64_t n0, int64_t n1, float *sums, float *halves, float *row, uint16_t *xb) {
    int64_t row_bytes = weight_row_bytes(kind, K);
    int64_t size = scale ? bw : K;
    int shifted = zero_kind != 0 || offset != 0.0f;
    int vnni = 0;  /* integer weights by x's 15-bit runs and VNNI's byte products (VNNI_RUNS) */
#ifdef VNNI_RUNS
    float *vs = xb ? (float *)(xb + M * K) : 0;
    if (xb && scale && i8_fits(kind, K, size)) {
        vnni = i8_activations(kind, M, K, size, x, (uint8_t *)xb, vs, shifted || kind == 2, sums, KB);
        shifted = shifted || (vnni && kind == 2);  /* int8's flipped sign bit: 128 more per value */
    }
#endif
#ifdef BF16_DOT
    /* FP8 at one row only: at several, the float32 loops' multiply-adds (two ports) outran the dot products (one
       per ~2 cycles here), 5-14% */
    int dot = xb && ((kind == 0 && !shifted) || (kind == 5 && M == 1) ||
                     (kind == 4 && scale && K % 128 == 0 && size % 128 == 0 && !vnni));
    float bias = kind == 4 ? BF16_INT4_BIAS : 0.0f;
    shifted = shifted || (dot && kind == 4);
#else
    int dot = 0;
    (void)xb;
#endif
    float factor = kind == 1 ? FP16_FACTOR : kind == 5 ? 0x1p120f : 1.0f;  /* multiplies each output back */
    if (factor != 1.0f) {  /* x times 2^64 into `halves` (exact: a power of two), so products of weights placed at
        2^-120 (FP8) or 2^-112 (fp16 without AVX-512) stay normal floats: unscaled, an activation under ~2^-6 times a
        small weight made a denormal, which the CPU multiplies in microcode (FP8: 15x slower at activations of 1e-3)
        and with fewer bits */
        float amax = 0.0f;
        for (int64_t i = 0; i < M * K; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float up = amax < 0x1p62f ? 0x1p64f : 1.0f;  /* not past float32's range (inf and NaN: left as they are) */
        for (int64_t i = 0; i < M * K; i++) halves[i] = x[i] * up;
        x = halves;
        factor /= up;
    }
#ifdef BF16_DOT
    if (dot) bf16_activations(kind, M, K, x, xb);  /* (after the scaling: x times 2^64 is still bf16 values) */
#endif
    int x16 = 0;  /* integer weights by the int16 runs of x (AVX2 builds; see X16) */
#ifdef X16
    int64_t unit = xb && scale ? x16_unit(kind, K, size) : 0;
    float *xs = xb ? (float *)(xb + M * K) : 0;
    x16 = unit && x16_activations(kind, M, K, unit, size, x, (int16_t *)xb, xs, shifted, sums, KB);
#endif
    if (shifted && !x16 && !vnni)
        for (int64_t m = 0; m < M; m++)
            for (int64_t b = 0; b < KB; b++) {
                float s = 0.0f;
                for (int64_t k = b * bw; k < K && k < (b + 1) * bw; k++) s += x[m * K + k];
                sums[m * KB + b] = s;
            }
    if (kind == 4 && !dot && !x16 && !vnni)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < K / 2; j++) {
                halves[m * K + j] = x[m * K + 2 * j];
                halves[m * K + K / 2 + j] = x[m * K + 2 * j + 1];
            }
    const float *s_row = 0, *z_row = 0;  /* the row block's scales and zero points, float32 */
    for (int64_t n = n0, r = -1; n < n1; n++) {
        const uint8_t *wn = (const uint8_t *)w + n * row_bytes;
        /* ask for the row's worth of bytes AHEAD on (within the rows this call reads): their reads then overlap
           this row's arithmetic */
        for (int64_t at = AHEAD; at < AHEAD + row_bytes && at < (n1 - n) * row_bytes; at += 64)
            __builtin_prefetch(wn + at, 0, 3);
        if (scale && n / bh != r) {  /* a new block of rows: its scales (read in place when float32), zero points */
            r = n / bh;
            if (scale_kind == 0) s_row = (const float *)scale + r * KB;
            else { scales_row(scale_kind, scale, r * KB, KB, row); s_row = row; }
            if (zero_kind) { zeros_row(zero_kind, zero, zero_bits, r, KB, offset, row + KB); z_row = row + KB; }
        }
        for (int64_t m0 = 0; m0 < M; m0 += MC_MAX) {  /* up to MC_MAX rows share each decode of the weight row */
            int mc = M - m0 < MC_MAX ? (int)(M - m0) : MC_MAX;
            float out[MC_MAX];
#ifdef VNNI_RUNS
            if (vnni) {
                struct shift sh = {z_row, offset, kind == 2 ? VNNI_INT8_BIAS : 0.0f, sums ? sums + m0 * KB : 0, KB};
                i8_rows(kind, mc, K, (const uint8_t *)xb + 2 * m0 * K, vs + m0 * (K / I8_RUN), wn, size, s_row,
                        shifted ? &sh : 0, out);
            } else
#endif
#ifdef BF16_DOT
            if (dot) {
                dot_bf16(kind, mc, K, xb + m0 * K, wn, size, s_row, out);
                if (shifted)  /* the blocks' zero points, offset and bias times the sums of x */
                    for (int m = 0; m < mc; m++)
                        out[m] -= shift_sum(KB, s_row, z_row, offset, bias, sums + (m0 + m) * KB);
            } else
#endif
#ifdef X16
            if (x16)
                x16_rows(kind, mc, K, unit, (const int16_t *)xb + m0 * K, xs + m0 * (K / unit), wn, size, s_row,
                         z_row, offset, shifted, sums ? sums + m0 * KB : 0, KB, out);
            else
#endif
            rows(kind, mc, K, x + m0 * K, halves ? halves + m0 * K : 0, wn, size, s_row, z_row, offset, shifted,
                 sums ? sums + m0 * KB : 0, KB, out);
            for (int m = 0; m < mc; m++)
                y[(m0 + m) * N + n] = out[m] * factor;
        }
    }
}

/* The bf16 word of f, rounded to nearest, ties to even (a NaN: 0x7FC0), as torch rounds */
static inline uint16_t bf16_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

/* tp_gemv for a bf16 model's activations and outputs as torch holds them (bf16 bits): x16 widened into `xf` (M x K,
   exact), the float32 outputs of rows n0..n1 into `yf` (M x N) and rounded into y16, so a call needs no conversions
   around it (torch's two cost more than a small layer's product). */
static void tp_gemv_bf16(int kind, int64_t M, int64_t N, int64_t K, const uint16_t *x16, const void *w,
                         const void *scale, int scale_kind, const void *zero, int zero_kind, int zero_bits,
                         float offset, int64_t bh, int64_t bw, int64_t KB, uint16_t *y16, int64_t n0, int64_t n1,
                         float *sums, float *halves, float *row, uint16_t *xb, float *xf, float *yf) {
    for (int64_t i = 0; i < M * K; i++) xf[i] = bits_float((uint32_t)x16[i] << 16);
    tp_gemv(kind, M, N, K, xf, w, scale, scale_kind, zero, zero_kind, zero_bits, offset, bh, bw, KB, yf, n0, n1, sums,
            halves, row, xb);
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = n0; n < n1; n++) y16[m * N + n] = bf16_bits(yf[m * N + n]);
}

/* Weight bytes one task of a threaded product reads at least (`tp_rows_per_task`): a task costs its thread's start
   and join, a few microseconds, about what 128 KiB take to stream from memory; a task reads twice that or more. */
#define TASK_BYTES (256 * 1024)

/* The fewest weight rows of `kind` (K columns) worth a thread of their own: the grain the op's kernel splits a
   product's rows by (`gemv_op.cpp`), so that a small layer runs on its caller's thread alone. */
int64_t tp_rows_per_task(int kind, int64_t K) {
    int64_t row_bytes = weight_row_bytes(kind, K);
    return row_bytes > 0 ? (TASK_BYTES + row_bytes - 1) / row_bytes : 1;
}

/* One product as a caller holds its tensors, the scratch laid out here in one buffer of `bytes` (64-byte aligned):
   x and y float32, or bf16 words where `io` (tp_gemv_bf16); `bf16`: x's values are bf16, so the paths that read them
   as 16-bit words may. Returns the bytes the call needs; where `bytes` is fewer it computes nothing, and the caller
   grows its buffer and calls again. The scratch's sizes are known here only: `native.py`'s Python kernel and
   `gemv_op.cpp`'s C++ kernel of `tpkit::gemv` both call this. Computes the weight's rows n0..n1 (y's columns) only:
   threads given disjoint ranges, each with its own scratch, compute one product together. */
int64_t tp_gemv_call(int kind, int64_t M, int64_t N, int64_t K, const void *x, const void *w, const void *scale,
                     int scale_kind, const void *zero, int zero_kind, int zero_bits, float offset, int64_t bh,
                     int64_t bw, int64_t KB, void *y, int64_t n0, int64_t n1, int io, int bf16, uint8_t *scratch,
                     int64_t bytes) {
    int64_t blocks = KB > 1 ? KB : 1;
    int shifted = zero_kind != 0 || offset != 0.0f || kind == 4 || kind == 2;  /* int4's bf16 products and int8's
                                                                                   VNNI products carry a bias */
    int scaled = kind == 4 || kind == 5 || kind == 1;  /* x de-interleaved (int4) or scaled up (FP8, fp16) */
    int words = bf16 && kind != 1;  /* the kinds the bf16 dot products or the int16 runs may take */
    int64_t sizes[6] = {shifted ? 4 * M * blocks : 0, scaled ? 4 * M * K : 0, 8 * blocks,
                        words ? 2 * M * K + 4 * M * (K / 32) : 0, io ? 4 * M * K : 0, io ? 4 * M * N : 0};
    int64_t at[6], total = 0;
    for (int i = 0; i < 6; i++) {
        at[i] = total;
        total += (sizes[i] + 63) / 64 * 64;
    }
    if (bytes < total) return total;
    void *area[6];
    for (int i = 0; i < 6; i++) area[i] = sizes[i] ? scratch + at[i] : 0;
    if (io)
        tp_gemv_bf16(kind, M, N, K, (const uint16_t *)x, w, scale, scale_kind, zero, zero_kind, zero_bits, offset, bh,
                     bw, KB, (uint16_t *)y, n0, n1, area[0], area[1], area[2], area[3], area[4], area[5]);
    else
        tp_gemv(kind, M, N, K, (const float *)x, w, scale, scale_kind, zero, zero_kind, zero_bits, offset, bh, bw, KB,
                (float *)y, n0, n1, area[0], area[1], area[2], area[3]);
    return total;
}
