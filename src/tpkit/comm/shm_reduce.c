/* One small all-reduce (SUM) through the shared-memory segment of `shm.py`, in one call from Python.

   In Python the protocol's steps (wait for the bank, copy into this rank's slot, publish, wait for every rank, add
   the slots, publish done) are each a torch call or a bytecode loop of ~0.1-0.9 us: 4-5 us of a 4 KiB all-reduce
   that the memory traffic itself does in well under one. Here they run as one C function with the same flags,
   slots and order, so Python and C calls interleave freely on one segment.

   `ctx` (int64): the segment's address, this rank, the ranks, the bytes of a slot, the bytes of the flags, and
   the spins a wait may take before it hands the wait back to Python (which knows the timeout and checks that the
   peers live). Flags: rank r's line holds `arrived` at word 8r and `done` at 8r + 1. The sum runs in rank order,
   each addition rounded to the dtype as torch rounds `a + b`, so every rank gets bitwise torch's result (a NaN's
   bits aside: bf16 NaN is 0x7FC0 here, torch's vector loop writes 0xFFFF).

   Returns 0 when done; 1 when a peer has not finished call `seq - 2` (nothing written yet); 2 when a peer has not
   arrived at `seq` (this rank's data is published). Python waits on its own, then calls again with `start` = that
   code, which resumes at that step. */
#include <sched.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define RELAX() _mm_pause()
#else
#define RELAX() ((void)0)
#endif

enum { F32 = 0, F64 = 1, BF16 = 2 };
#define LINE_WORDS 8 /* int64 words of flags per rank: one 64-byte line */
#define YIELD_EVERY 16 /* spins between yields: a rank sharing a core with the one it waits for lets it run */

static int wait_all(volatile int64_t *flags, int64_t n, int word, int64_t seq, int64_t budget) {
    for (int64_t p = 0; p < n; p++) {
        volatile int64_t *flag = flags + p * LINE_WORDS + word;
        int64_t spins = 0;
        while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq) {
            if (++spins > budget) return 1;
            if (spins % YIELD_EVERY == 0) sched_yield(); else RELAX();
        }
    }
    return 0;
}

static inline float bf16_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t float_bf16(float f) { /* round to nearest even, as c10::BFloat16; NaN becomes 0x7FC0 */
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if (f != f) return 0x7FC0;
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

static void sum_f32(float *restrict out, char *const *slot, int64_t n, int64_t count) {
    const float *a = (const float *)slot[0], *b = (const float *)slot[1];
    for (int64_t i = 0; i < count; i++) out[i] = a[i] + b[i];
    for (int64_t r = 2; r < n; r++) {
        const float *c = (const float *)slot[r];
        for (int64_t i = 0; i < count; i++) out[i] += c[i];
    }
}

static void sum_f64(double *restrict out, char *const *slot, int64_t n, int64_t count) {
    const double *a = (const double *)slot[0], *b = (const double *)slot[1];
    for (int64_t i = 0; i < count; i++) out[i] = a[i] + b[i];
    for (int64_t r = 2; r < n; r++) {
        const double *c = (const double *)slot[r];
        for (int64_t i = 0; i < count; i++) out[i] += c[i];
    }
}

static void sum_bf16(uint16_t *restrict out, char *const *slot, int64_t n, int64_t count) {
    for (int64_t i = 0; i < count; i++) {
        uint16_t acc = float_bf16(bf16_float(((const uint16_t *)slot[0])[i]) + bf16_float(((const uint16_t *)slot[1])[i]));
        for (int64_t r = 2; r < n; r++) acc = float_bf16(bf16_float(acc) + bf16_float(((const uint16_t *)slot[r])[i]));
        out[i] = acc;
    }
}

int tp_shm_all_reduce(const int64_t *ctx, int64_t seq, const void *src, void *out, int64_t count, int dtype,
                      int start) {
    char *base = (char *)(intptr_t)ctx[0];
    int64_t rank = ctx[1], n = ctx[2], slot_bytes = ctx[3], flag_bytes = ctx[4], budget = ctx[5];
    volatile int64_t *flags = (volatile int64_t *)base;
    static const int64_t size[] = {4, 8, 2};
    char *slot[64];
    for (int64_t r = 0; r < n; r++) slot[r] = base + flag_bytes + ((seq & 1) * n + r) * slot_bytes;
    if (start < 2) {
        if (seq > 2 && wait_all(flags, n, 1, seq - 2, budget)) return 1;
        memcpy(slot[rank], src, (size_t)(count * size[dtype]));
        __atomic_store_n((int64_t *)(flags + rank * LINE_WORDS), seq, __ATOMIC_RELEASE);
    }
    if (wait_all(flags, n, 0, seq, budget)) return 2;
    if (dtype == F32) sum_f32((float *)out, slot, n, count);
    else if (dtype == F64) sum_f64((double *)out, slot, n, count);
    else sum_bf16((uint16_t *)out, slot, n, count);
    __atomic_store_n((int64_t *)(flags + rank * LINE_WORDS + 1), seq, __ATOMIC_RELEASE);
    return 0;
}
