/* The CPU kernel of the op `tpkit::gemv` in C++: the dispatcher calls gemv.c's product (`tp_gemv_call`, bound by
   `native.py` to the build it loaded: `tp_bind`) with no Python between. Through the Python kernel, a compiled
   graph's call paid ~3 us more (the dispatch into Python and ctypes' conversions; 0.6 us of an eager call, which
   calls that kernel directly): ~0.2 ms of a TP2 decoded token's 57 products. `native.py` builds this
   where a C++ compiler and torch's headers are at hand; elsewhere the Python kernel stays. The op's schema and its
   fake implementation are defined in `native.py`; this file registers the CPU kernel only.

   A product of two tasks' rows or more (`tp_rows_per_task` each: at least 256 KiB of weight) is split by weight
   rows over as many threads as torch's intra-op setting allows (`torch.set_num_threads`; one where a rank has one
   thread, as `tpkit.launch` gives each rank of a full host): a decode product reads its weight once, and one core's
   decode and multiply-adds fall short of what the memory streams to two (int4, FP8). The team is sized here from
   torch's setting, not from the OpenMP runtime's own default, so a build that loads another OpenMP runtime than
   torch's still runs no more threads than torch would. Each thread computes its own rows with its own scratch (the
   activations' preparation repeated per thread: K values, against the rows' K each), so the result is the same bit
   for bit at any thread count. */
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <optional>
#include <vector>

typedef int64_t (*product_fn)(int, int64_t, int64_t, int64_t, const void *, const void *, const void *, int,
                              const void *, int, int, float, int64_t, int64_t, int64_t, void *, int64_t, int64_t, int,
                              int, uint8_t *, int64_t);
typedef int64_t (*grain_fn)(int, int64_t);
static product_fn product = nullptr;
static grain_fn rows_per_task = nullptr;

extern "C" void tp_bind(void *fn, void *grain) {
    product = reinterpret_cast<product_fn>(fn);
    rows_per_task = reinterpret_cast<grain_fn>(grain);
}

/* Whether this build splits products over threads (compiled with OpenMP, as torch's parallel backend is): without,
   every product runs on its caller's thread. */
extern "C" int tp_threaded(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

static thread_local int64_t last_tasks = 0;  /* the tasks this thread's last product was split into */

/* How many tasks the calling thread's last product ran as (1: on the caller's thread alone): what the tests check
   the split by, since its result is the same either way. */
extern "C" int64_t tp_last_tasks(void) { return last_tasks; }

static const void *address(const std::optional<at::Tensor> &t) { return t.has_value() ? t->data_ptr() : nullptr; }

/* x `[M, K]` float32 or bf16 (contiguous) times the stored weight: `[M, n]` in x's dtype. The scale and zero-point
   kinds and the blocks per row (`kb`) come computed by `native.gemv`, where the dtypes' codes live. */
static at::Tensor gemv(const at::Tensor &x, const at::Tensor &w, int64_t kind, const std::optional<at::Tensor> &scale,
                       int64_t scale_kind, const std::optional<at::Tensor> &zero, int64_t zero_kind, int64_t zero_bits,
                       int64_t bh, int64_t bw, int64_t kb, int64_t n, double offset, bool bf16) {
    TORCH_CHECK(product != nullptr, "tpkit::gemv: no product bound (tpkit.quant.native loads it)");
    const int64_t m = x.size(0), k = x.size(1);
    at::Tensor y = at::empty({m, n}, x.options());
    const int io = x.scalar_type() == at::kBFloat16;
    const void *xp = x.data_ptr(), *wp = w.data_ptr(), *sp = address(scale), *zp = address(zero);
    void *yp = y.data_ptr();
    auto rows = [&](int64_t n0, int64_t n1) {
        thread_local std::vector<uint8_t> buffer;  /* one per thread (thread-ranks, the team's), grown as needed */
        for (;;) {
            uint8_t *base = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64;
            const int64_t room = buffer.size() < 64 ? 0 : static_cast<int64_t>(buffer.size()) - 64;
            const int64_t need = product(static_cast<int>(kind), m, n, k, xp, wp, sp, static_cast<int>(scale_kind),
                                         zp, static_cast<int>(zero_kind), static_cast<int>(zero_bits),
                                         static_cast<float>(offset), bh, bw, kb, yp, n0, n1, io, bf16 ? 1 : 0, base,
                                         room);
            if (need <= room) return;
            buffer.resize(need + 64);
        }
    };
    const int64_t grain = rows_per_task(static_cast<int>(kind), k);
    const int64_t tasks = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), n / grain);
    last_tasks = tasks < 1 ? 1 : tasks;
    if (tasks <= 1) {
        rows(0, n);
        return y;
    }
    const int64_t chunk = (n + tasks - 1) / tasks;
    std::exception_ptr failed = nullptr;
#pragma omp parallel for num_threads(tasks) schedule(static, 1)
    for (int64_t t = 0; t < tasks; t++) {
        try {
            rows(t * chunk, std::min(n, (t + 1) * chunk));
        } catch (...) {  /* (a scratch that could not grow) raised once the team is done */
#pragma omp critical
            if (!failed) failed = std::current_exception();
        }
    }
    if (failed) std::rethrow_exception(failed);
    return y;
}

TORCH_LIBRARY_IMPL(tpkit, CPU, m) { m.impl("gemv", TORCH_FN(gemv)); }
