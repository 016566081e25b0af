// What the CPU kernels share: 16-lane vectors (the matmuls) and a parallel loop over helper
// threads that stay awake through a decode step (all of them).
#ifndef JAXKV_CPU_KERNELS_KERNEL_COMMON_H_
#define JAXKV_CPU_KERNELS_KERNEL_COMMON_H_

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxkv_cpu {

constexpr int64_t kLanes = 16;  // floats of one vector (one AVX-512 register, two AVX2 ones)

// GCC / Clang vector extensions of kLanes lanes (the build's widest registers carry them).
typedef uint8_t VBytes __attribute__((vector_size(kLanes)));
typedef int8_t VSBytes __attribute__((vector_size(kLanes)));
typedef uint16_t VShorts __attribute__((vector_size(2 * kLanes)));
typedef int16_t VSShorts __attribute__((vector_size(2 * kLanes)));
typedef int32_t VInts __attribute__((vector_size(4 * kLanes)));
typedef uint32_t VUInts __attribute__((vector_size(4 * kLanes)));
typedef float VFloats __attribute__((vector_size(4 * kLanes)));

constexpr int64_t kGroup = 4;  // rows of x a matmul kernel handles together (one widening)

template <int R>
using Rows = std::integral_constant<int, R>;

// Calls f(Rows<R>(), i) for the groups of rows [i, i + R) of m, R <= kGroup (R a compile-time
// constant, so the loops over a group's rows unroll).
template <typename F>
inline void ForGroups(int64_t m, F&& f) {
  for (int64_t i = 0; i < m; i += kGroup) {
    switch (std::min(kGroup, m - i)) {
      case 1: f(Rows<1>(), i); break;
      case 2: f(Rows<2>(), i); break;
      case 3: f(Rows<3>(), i); break;
      default: f(Rows<4>(), i);
    }
  }
}

// kLanes floats at p (unaligned). Out-parameters, not return values: a 64-byte vector returned
// by value changes the ABI with the build's vector extensions (a -Wpsabi note).
inline void Load(VFloats& v, const float* p) { std::memcpy(&v, p, sizeof(v)); }
inline void Store(float* p, const VFloats& v) { std::memcpy(p, &v, sizeof(v)); }

// IEEE half bits -> float, branch-free so the loops that call it vectorize: a normal number
// moves its exponent and mantissa into a float's fields and rebiases the exponent (+112); a
// subnormal (exponent 0) is its mantissa times 2^-24, computed as a float product; exponent 31
// (infinity, NaN) becomes exponent 255 with the mantissa kept.
inline float HalfToFloat(uint16_t h) {
  const uint32_t mag = h & 0x7fffu;
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = mag >> 10;
  const float normal = __builtin_bit_cast(float, (mag << 13) + (112u << 23));
  const float subnormal = static_cast<float>(mag) * (1.0f / 16777216.0f);
  const uint32_t special = (mag << 13) | 0x7f800000u;
  const uint32_t bits = exponent == 0    ? __builtin_bit_cast(uint32_t, subnormal)
                        : exponent == 31 ? special
                                         : __builtin_bit_cast(uint32_t, normal);
  return __builtin_bit_cast(float, bits | sign);
}

// A scale or offset array as stored: f32, or f16 bits (the matmuls read f16 as stored:
// converting it to f32 before the call would write and read again a share of the weights' bytes).
struct Params {
  const void* data;
  bool half;
};

// Values [at, at + count) of a as floats: a pointer into a (f32), or converted into buf (f16).
inline const float* Floats(const Params& a, int64_t at, int64_t count, float* __restrict__ buf) {
  if (!a.half) return static_cast<const float*>(a.data) + at;
  const uint16_t* __restrict__ h = static_cast<const uint16_t*>(a.data) + at;
  int64_t j = 0;
#if defined(__F16C__)
  for (; j + 8 <= count; j += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j));
    _mm256_storeu_ps(buf + j, _mm256_cvtph_ps(bits));
  }
#endif
  for (; j < count; ++j) buf[j] = HalfToFloat(h[j]);
  return buf;
}

// The threads a kernel uses: the caller's num_threads attribute (the process's CPUs), at most
// XLA's pool plus the calling thread.
inline int Threads(const xla::ffi::ThreadPool& pool, int32_t num_threads) {
  const int64_t pool_threads = pool.num_threads();
  return static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>(num_threads, pool_threads > 0 ? pool_threads + 1 : 1)));
}

// Process-wide helper threads that stay awake for a moment between kernels. A decode step calls
// a matmul kernel every few tens of microseconds; XLA's intra-op pool parks its threads between
// them, and a parked thread takes about as long to wake as a 576 x 576 int8 matmul takes to
// run (measured: a helper from that pool made such a matmul no faster). These helpers spin for
// kSpinMicros after each job, so the kernels of one step find them awake, then park (a
// condition variable), so an idle engine costs nothing. One job at a time: a kernel that finds
// the helpers busy (another device's kernel, in tensor-parallel CPU runs) uses XLA's pool.
// Never destroyed (threads are detached and may still run at exit); rebuilt in a forked child.
class Helpers {
 public:
  static constexpr int64_t kSpinMicros = 200;
  static constexpr int kMaxHelpers = 63;

  // The helpers of this process (created on first use with `count` threads).
  static Helpers* Get(int count) {
    static std::mutex create_mu;
    static Helpers* helpers = nullptr;
    std::lock_guard<std::mutex> lock(create_mu);
    if (helpers == nullptr || helpers->pid_ != getpid()) {  // first use, or a forked child
      helpers = new Helpers(std::min(std::max(count, 0), kMaxHelpers));
    }
    return helpers;
  }

  int size() const { return static_cast<int>(threads_); }

  // Whether a helper is spinning now (a kernel ran within the last kSpinMicros).
  bool Awake() const { return spinning_.load(std::memory_order_relaxed) > 0; }

  // Runs run() on up to `helpers` helpers (run() takes the job's parts itself and returns when
  // none is left), and returns without running anything when another job holds the helpers.
  // Returns once every helper that joined has left run(): the caller's state may then go.
  template <typename Run>
  bool TryJoin(int helpers, Run&& run_on_caller, const std::function<void()>& run) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || helpers <= 0) return false;
    wanted_.store(helpers);
    job_.store(&run);
    {
      std::lock_guard<std::mutex> lock(mu_);
      spin_generation_.store(++generation_, std::memory_order_release);
    }
    wake_.notify_all();
    run_on_caller();
    job_.store(nullptr);
    while (active_.load() != 0) Pause();
    return true;
  }

 private:
  explicit Helpers(int count) : pid_(getpid()), threads_(count) {
    for (int t = 0; t < count; ++t) std::thread([this] { Loop(); }).detach();
  }

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  void Loop() {
    uint64_t seen = 0;
    for (;;) {
      {  // spin for a new generation, then park
        const auto until =
            std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinMicros);
        int polls = 0;
        bool spinning = true;
        spinning_.fetch_add(1);
        while (spin_generation_.load(std::memory_order_acquire) == seen) {
          Pause();
          if (++polls % 64 == 0 && std::chrono::steady_clock::now() > until) {
            spinning_.fetch_sub(1);
            spinning = false;
            std::unique_lock<std::mutex> lock(mu_);
            wake_.wait(lock, [&] { return generation_ != seen; });
            break;
          }
        }
        if (spinning) spinning_.fetch_sub(1);
      }
      seen = spin_generation_.load(std::memory_order_acquire);
      // Join the job if it still wants helpers; the caller waits for active_ to drain.
      active_.fetch_add(1);
      const std::function<void()>* job = job_.load();
      if (job != nullptr && wanted_.fetch_sub(1) > 0) (*job)();
      active_.fetch_sub(1);
    }
  }

  const pid_t pid_;
  const int threads_;
  std::mutex busy_;  // held by the job's caller
  std::mutex mu_;
  std::condition_variable wake_;
  uint64_t generation_ = 0;                   // jobs posted (under mu_)
  std::atomic<uint64_t> spin_generation_{0};  // generation_, for the spinning helpers
  std::atomic<const std::function<void()>*> job_{nullptr};
  std::atomic<int> wanted_{0};  // helpers the job still takes
  std::atomic<int> active_{0};  // helpers between joining and leaving a job
  std::atomic<int> spinning_{0};  // helpers spinning for the next job (not parked)
};

// Who runs a ParallelFor's parts besides the calling thread.
enum class Team {
  kHelpers,         // the Helpers (XLA's pool when another job holds them)
  kHelpersIfAwake,  // the Helpers only while they spin (a matmul kernel ran just before)
  kPool,            // XLA's intra-op pool
};

// Runs task(part) for every part in [0, parts): on the calling thread and on up to threads - 1
// helpers (Helpers or XLA's intra-op pool, as `team` says), each taking the next part not yet
// taken; returns when all parts are done. A pool helper that starts after the last part was
// taken touches only the shared counters (held by shared_ptr), never the task's captures.
// kHelpersIfAwake (the attention kernel): between XLA's own ops (a float model's matmuls) the
// helpers' spin after each call would take a core from XLA's threads (tiny-llama f32 steps
// ran ~8% slower), so there XLA's pool runs the parts. kPool: jobs of milliseconds, for which
// waking a parked pool thread costs nothing and a spinning helper would compete with XLA's.
template <typename Task>
void ParallelFor(xla::ffi::ThreadPool& pool, int threads, int parts, Task task,
                 Team team_kind = Team::kHelpers) {
  struct Shared {
    explicit Shared(Task t, int n) : task(std::move(t)), parts(n) {}
    Task task;
    const int parts;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
    std::mutex mu;
    std::condition_variable all_done;
    void Run() {
      for (int w; (w = next.fetch_add(1)) < parts;) {
        task(w);
        if (done.fetch_add(1) + 1 == parts) {
          std::lock_guard<std::mutex> lock(mu);
          all_done.notify_all();
        }
      }
    }
  };
  if (parts <= 0) return;
  auto shared = std::make_shared<Shared>(std::move(task), parts);
  const int helpers = std::min(threads, parts) - 1;
  if (helpers <= 0) {
    shared->Run();
    return;
  }
  const std::function<void()> run = [&shared] { shared->Run(); };
  Helpers* team = Helpers::Get(threads - 1);
  const bool helpers_join = team_kind == Team::kHelpers ||
                            (team_kind == Team::kHelpersIfAwake && team->Awake());
  if (helpers_join && team->TryJoin(helpers, [&] { shared->Run(); }, run)) {
    // Every part was taken; the helpers that joined have left, so the parts are done.
    return;
  }
  for (int t = 0; t < helpers; ++t) pool.Schedule([shared] { shared->Run(); });
  shared->Run();
  std::unique_lock<std::mutex> lock(shared->mu);
  shared->all_done.wait(lock, [&] { return shared->done.load() == parts; });
}

}  // namespace jaxkv_cpu

#endif  // JAXKV_CPU_KERNELS_KERNEL_COMMON_H_
