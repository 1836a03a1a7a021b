// The fibers, collectives and mbarriers of warp_emulator.h.
//
// A fiber starts on its own stack through makecontext / swapcontext, and every later switch is
// a _setjmp / _longjmp pair: swapcontext saves and restores the signal mask, a system call
// each way, which took a third of the tests' time.
#undef _FORTIFY_SOURCE  // __longjmp_chk refuses a jump to another stack
#include "warp_emulator.h"

#include <setjmp.h>
#include <ucontext.h>

#ifdef MINIKV_EMULATION_ASAN
#include <dlfcn.h>
#include <sanitizer/common_interface_defs.h>
#endif

#include <cuda.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <vector>

namespace minikv {
namespace emulation {
namespace {

enum class Op { kSyncwarp, kShfl, kShflXor, kShflDown, kShflUp, kBallot, kMatchAny, kLdmatrix, kLdmatrixTrans, kMmaF16, kMmaBF16 };
const char *op_name(Op op) {
  switch (op) {
    case Op::kSyncwarp: return "__syncwarp";
    case Op::kShfl: return "__shfl_sync";
    case Op::kShflXor: return "__shfl_xor_sync";
    case Op::kShflDown: return "__shfl_down_sync";
    case Op::kShflUp: return "__shfl_up_sync";
    case Op::kBallot: return "__ballot_sync";
    case Op::kMatchAny: return "__match_any_sync";
    case Op::kLdmatrix: return "ldmatrix";
    case Op::kLdmatrixTrans: return "ldmatrix.trans";
    case Op::kMmaF16: return "mma f16";
    case Op::kMmaBF16: return "mma bf16";
  }
  return "?";
}

[[noreturn]] void die(const char *what) {
  std::fprintf(stderr, "warp emulator: %s\n", what);
  std::fflush(stderr);
  std::abort();
}

constexpr size_t kStackBytes = 1024 * 1024;

// AddressSanitizer follows stack switches only when told (its fake stacks for use-after-return
// belong to one stack each): start before a jump, with the destination's bounds and where to
// save the fake stack of the stack being left, finish after it with the destination's.
void asan_switch_start(void **save, const void *bottom, size_t size) {
#ifdef MINIKV_EMULATION_ASAN
  __sanitizer_start_switch_fiber(save, bottom, size);
#else
  (void)save, (void)bottom, (void)size;
#endif
}
void asan_switch_finish(void *save, const void **from_bottom, size_t *from_size) {
#ifdef MINIKV_EMULATION_ASAN
  __sanitizer_finish_switch_fiber(save, from_bottom, from_size);
#else
  (void)save, (void)from_bottom, (void)from_size;
#endif
}

#ifdef MINIKV_EMULATION_ASAN
extern "C" int __asan_option_detect_stack_use_after_return;  // the runtime's ASAN_OPTIONS flag
#endif

// A jump to another fiber. The sanitizer's _longjmp interceptor takes every jump for an unwind
// of the stack being left: a sigaltstack system call and a shadow clear each time, a third of
// the sanitized tests' time. With use-after-return detection on (scripts/reliability.sh) the
// instrumented frames live on fake stacks, whose switches are announced, and the jump goes
// straight to libc's _longjmp. With it off (ASan's default) the frames are on the fiber's own
// stack, which later fibers reuse; frames a jump leaves behind keep their redzones poisoned
// until that clear removes them, so the interceptor stays. Not declared noreturn: the
// instrumentation would call the unwind before it.
void jump(jmp_buf to) {
#ifdef MINIKV_EMULATION_ASAN
  using Longjmp = void (*)(jmp_buf, int);
  static const Longjmp libc_longjmp = [] {
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    void *fn = libc != nullptr ? dlsym(libc, "_longjmp") : nullptr;
    if (fn == nullptr) die("libc's _longjmp not found");
    return reinterpret_cast<Longjmp>(fn);
  }();
  if (__asan_option_detect_stack_use_after_return == 0) _longjmp(to, 1);
  libc_longjmp(to, 1);
#else
  _longjmp(to, 1);
#endif
}

// A copy into shared memory not landed yet: a bulk copy (completing on an mbarrier) or a
// cp.async of 16 bytes.
struct PendingCopy {
  uint32_t dst, bytes;
  const void *src;  // nullptr: zero fill
};

// A wgmma issued and not waited for yet: its product, computed at issue, lands in d at the
// wgmma.wait_group that covers its commit group. Until then d reads NaN and the A registers
// it read must keep their values (the hardware reads both asynchronously).
struct PendingWgmma {
  float *d;
  std::vector<float> result;
  const uint32_t *a;  // nullptr: A from shared memory
  std::array<uint32_t, 4> a_bits;
  // The shared-memory operand elements this thread's part of the product read (swizzled
  // addresses, bits), which must not change before the wait either.
  std::vector<std::pair<uint32_t, uint16_t>> smem_read;
};

// A fiber's stack, kept from launch to launch: a fresh one per launch costs its page faults
// again, and under AddressSanitizer a fake stack (use-after-return frames, megabytes mapped
// and unmapped) per thread per CTA; the two were most of the sanitized tests' time.
struct FiberStack {
  std::unique_ptr<char[]> bytes{new char[kStackBytes]};
  void *asan_fake_stack = nullptr;  // saved while the fiber is switched out or between CTAs
};
std::vector<std::unique_ptr<FiberStack>> &fiber_stacks() {
  static std::vector<std::unique_ptr<FiberStack>> stacks;
  return stacks;
}

struct Thread {
  ucontext_t ctx{};  // its start
  jmp_buf resume;    // where it blocked
  bool started = false;
  FiberStack *stack = nullptr;
  uint3 tid{};
  uint32_t warp = 0, lane = 0;
  bool done = false;
  enum class Wait { kNone, kCollective, kCta, kNamed, kSpin } wait = Wait::kNone;
  uint64_t wait_gen = 0;
  uint32_t wait_bar = 0;  // kNamed: the barrier
  std::vector<PendingCopy> open_group;          // cp.async not committed yet
  std::deque<std::vector<PendingCopy>> groups;  // committed, not landed (oldest first)
  std::vector<PendingWgmma> wg_open;                // wgmma not committed yet
  std::deque<std::vector<PendingWgmma>> wg_groups;  // committed, not waited for (oldest first)
};

// A warp's collective in progress: each lane's inputs, then its outputs.
struct Warp {
  uint32_t live = 0, arrived = 0;
  uint64_t gen = 0;
  Op op[32];
  uint32_t in[32][6];
  float fin[32][4];
  const uint8_t *addr[32];
  uint32_t out[32][4];
  float fout[32][4];
};

struct Mbar {
  uint32_t count = 0, pending = 0, phase = 0;
  int64_t tx = 0;
};

struct Launch {
  dim3 grid, block;
  uint3 bidx{};
  uint8_t *smem = nullptr;
  size_t smem_bytes = 0;
  CopyLanding landing = CopyLanding::kAtIssue;
  const std::function<void()> *body = nullptr;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  uint32_t cta_live = 0, cta_arrived = 0;
  uint64_t cta_gen = 0;
  // Named barriers: 0-15 the kernel's (bar.sync), 16 + g warpgroup g's wgmma.
  uint32_t named_arrived[32] = {};
  uint64_t named_gen[32] = {};
  std::vector<std::array<uint32_t, 4>> wgmma_a;  // each thread's A fragment of its wgmma
  std::map<uint32_t, Mbar> mbars;
  std::map<uint32_t, std::vector<PendingCopy>> copies;  // kAtWait: not landed yet, per barrier
  ucontext_t sched{};
  jmp_buf back;  // the scheduler, where it resumed a thread
  void *asan_fake_stack = nullptr;
  const void *sched_bottom = nullptr;  // the scheduler's stack
  size_t sched_size = 0;
  Thread *cur = nullptr;
  bool progress = false;
};
Launch *g_launch = nullptr;
// Static __shared__ arrays: shared addresses from 2^31, relative to the first one seen.
constexpr uint32_t kStaticShared = 0x80000000u;
const uint8_t *g_static_anchor = nullptr;

Launch &L() {
  if (g_launch == nullptr) die("a device function was called outside an emulated launch");
  return *g_launch;
}
Thread &self() { return *L().cur; }

// Back to the scheduler until this thread may go on.
void block(Thread::Wait wait, uint64_t gen) {
  Launch &l = L();
  Thread &t = self();
  t.wait = wait;
  t.wait_gen = gen;
  if (_setjmp(t.resume) == 0) {
    asan_switch_start(&t.stack->asan_fake_stack, l.sched_bottom, l.sched_size);
    jump(l.back);
  }
  asan_switch_finish(t.stack->asan_fake_stack, &l.sched_bottom, &l.sched_size);
}

void complete_collective(Warp &w) {
  Launch &l = L();
  const uint32_t base = 32 * uint32_t(&w - l.warps.data());
  int first = -1;
  for (uint32_t lane = 0; lane < 32; ++lane) {
    if (base + lane >= l.threads.size() || l.threads[base + lane].done) continue;
    if (first < 0) first = int(lane);
    if (w.op[lane] != w.op[first]) {
      char msg[160];
      std::snprintf(msg, sizeof msg, "divergent collective: lane %d at %s, lane %u at %s", first,
                    op_name(w.op[first]), lane, op_name(w.op[lane]));
      die(msg);
    }
  }
  if (first < 0) return;
  const Op op = w.op[first];
  auto live = [&](uint32_t lane) { return base + lane < l.threads.size() && !l.threads[base + lane].done; };
  switch (op) {
    case Op::kSyncwarp: break;
    case Op::kShfl:
    case Op::kShflXor:
    case Op::kShflDown:
    case Op::kShflUp:
      for (uint32_t lane = 0; lane < 32; ++lane) {
        if (!live(lane)) continue;
        const uint32_t arg = w.in[lane][1];
        // Past the warp's ends a lane reads its own value.
        const uint32_t src = op == Op::kShfl        ? arg & 31u
                             : op == Op::kShflXor   ? (lane ^ arg) & 31u
                             : op == Op::kShflDown ? (lane + arg < 32 ? lane + arg : lane)
                                                    : (lane >= arg ? lane - arg : lane);
        if (!live(src)) die("a shuffle reads an exited lane");
        w.out[lane][0] = w.in[src][0];
      }
      break;
    case Op::kBallot: {
      uint32_t mask = 0;
      for (uint32_t lane = 0; lane < 32; ++lane)
        if (live(lane) && w.in[lane][0] != 0) mask |= 1u << lane;
      for (uint32_t lane = 0; lane < 32; ++lane) w.out[lane][0] = mask;
      break;
    }
    case Op::kMatchAny:
      for (uint32_t lane = 0; lane < 32; ++lane) {
        uint32_t peers = 0;
        for (uint32_t other = 0; other < 32; ++other)
          if (live(other) && w.in[other][0] == w.in[lane][0]) peers |= 1u << other;
        w.out[lane][0] = peers;
      }
      break;
    case Op::kLdmatrix:
    case Op::kLdmatrixTrans:
      for (uint32_t lane = 0; lane < 32; ++lane)
        if (!live(lane)) die("ldmatrix with an exited lane");
      for (uint32_t lane = 0; lane < 32; ++lane)
        for (uint32_t m = 0; m < 4; ++m) {
          auto elem = [&](uint32_t row, uint32_t col) {
            uint16_t v;
            std::memcpy(&v, w.addr[8 * m + row] + 2 * col, 2);
            return uint32_t(v);
          };
          const uint32_t r = lane / 4, c = 2 * (lane % 4);
          w.out[lane][m] = op == Op::kLdmatrix ? elem(r, c) | elem(r, c + 1) << 16
                                               : elem(c, r) | elem(c + 1, r) << 16;
        }
      break;
    case Op::kMmaF16:
    case Op::kMmaBF16: {
      for (uint32_t lane = 0; lane < 32; ++lane)
        if (!live(lane)) die("mma with an exited lane");
      auto value = [&](uint32_t word, int half) {
        const uint16_t bits = uint16_t(half ? word >> 16 : word & 0xffffu);
        if (op == Op::kMmaBF16) {
          const uint32_t f = uint32_t(bits) << 16;
          float x;
          std::memcpy(&x, &f, 4);
          return double(x);
        }
        __half_raw raw;
        raw.x = bits;
        return double(__half2float(__half(raw)));
      };
      double A[16][16], B[16][8], C[16][8];
      for (uint32_t lane = 0; lane < 32; ++lane) {
        const uint32_t gq = lane / 4, t = lane % 4;
        const uint32_t *a = w.in[lane];
        for (int h = 0; h < 2; ++h) {
          A[gq][2 * t + h] = value(a[0], h);
          A[gq + 8][2 * t + h] = value(a[1], h);
          A[gq][2 * t + 8 + h] = value(a[2], h);
          A[gq + 8][2 * t + 8 + h] = value(a[3], h);
          B[2 * t + h][gq] = value(a[4], h);
          B[2 * t + 8 + h][gq] = value(a[5], h);
        }
        C[gq][2 * t] = w.fin[lane][0];
        C[gq][2 * t + 1] = w.fin[lane][1];
        C[gq + 8][2 * t] = w.fin[lane][2];
        C[gq + 8][2 * t + 1] = w.fin[lane][3];
      }
      for (uint32_t lane = 0; lane < 32; ++lane) {
        const uint32_t gq = lane / 4, t = lane % 4;
        const uint32_t rows[4] = {gq, gq, gq + 8, gq + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
        for (int e = 0; e < 4; ++e) {
          double s = C[rows[e]][cols[e]];
          for (int k = 0; k < 16; ++k) s += A[rows[e]][k] * B[k][cols[e]];
          w.fout[lane][e] = float(s);
        }
      }
      break;
    }
  }
  w.arrived = 0;
  ++w.gen;
  l.progress = true;
}

// This lane's part of a collective: its inputs are in the warp's slots; returns when every
// lane's outputs are.
Warp &arrive(Op op) {
  Thread &t = self();
  Warp &w = L().warps[t.warp];
  w.op[t.lane] = op;
  if (++w.arrived == w.live) {
    complete_collective(w);
  } else {
    block(Thread::Wait::kCollective, w.gen);
  }
  return w;
}

void cta_barrier_check() {
  Launch &l = L();
  if (l.cta_arrived > 0 && l.cta_arrived == l.cta_live) {
    l.cta_arrived = 0;
    ++l.cta_gen;
    l.progress = true;
  }
}

void thread_entry() {
  Launch &l = L();
  Thread &t = self();
  asan_switch_finish(t.stack->asan_fake_stack, &l.sched_bottom, &l.sched_size);
  (*l.body)();
  if (!t.wg_open.empty() || !t.wg_groups.empty()) die("wgmma: a thread ended before waiting for its products");
  t.done = true;
  l.progress = true;
  Warp &w = l.warps[t.warp];
  --w.live;
  if (w.arrived > 0 && w.arrived == w.live) complete_collective(w);
  --l.cta_live;
  cta_barrier_check();
  asan_switch_start(&t.stack->asan_fake_stack, l.sched_bottom, l.sched_size);  // kept for the next fiber
  jump(l.back);  // never returns (its uc_link would resume a stale scheduler frame)
}

bool runnable(const Launch &l, const Thread &t) {
  if (t.done) return false;
  switch (t.wait) {
    case Thread::Wait::kNone:
    case Thread::Wait::kSpin: return true;
    case Thread::Wait::kCollective: return l.warps[t.warp].gen != t.wait_gen;
    case Thread::Wait::kCta: return l.cta_gen != t.wait_gen;
    case Thread::Wait::kNamed: return l.named_gen[t.wait_bar] != t.wait_gen;
  }
  return false;
}

// Runs t until it blocks or ends. Out of line: the caller's locals live across the jumps.
__attribute__((noinline)) void resume(Launch &l, Thread &t) {
  l.cur = &t;
  if (_setjmp(l.back) != 0) {
    asan_switch_finish(l.asan_fake_stack, nullptr, nullptr);
    return;
  }
  asan_switch_start(&l.asan_fake_stack, t.stack->bytes.get(), kStackBytes);
  if (!t.started) {
    t.started = true;
    swapcontext(&l.sched, &t.ctx);
  } else {
    jump(t.resume);
  }
}

void run_cta(Launch &l) {
  const uint32_t n = uint32_t(l.threads.size());
  for (uint32_t i = 0; i < n; ++i) {
    Thread &t = l.threads[i];
    t.done = false;
    t.started = false;
    t.open_group.clear();
    t.groups.clear();
    t.wg_open.clear();
    t.wg_groups.clear();
    t.wait = Thread::Wait::kNone;
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack->bytes.get();
    t.ctx.uc_stack.ss_size = kStackBytes;
    t.ctx.uc_link = &l.sched;
    makecontext(&t.ctx, thread_entry, 0);
  }
  for (uint32_t w = 0; w < l.warps.size(); ++w) {
    l.warps[w] = Warp{};
    l.warps[w].live = std::min(32u, n - 32 * w);
  }
  l.cta_live = n;
  l.cta_arrived = 0;
  l.mbars.clear();
  l.copies.clear();
  std::memset(l.smem, 0xa5, l.smem_bytes);  // unwritten shared memory reads as a pattern
  for (;;) {
    bool any = false;
    l.progress = false;
    for (uint32_t i = 0; i < n; ++i) {
      Thread &t = l.threads[i];
      if (!runnable(l, t)) continue;
      any = true;
      if (t.wait == Thread::Wait::kCollective || t.wait == Thread::Wait::kCta) l.progress = true;
      t.wait = Thread::Wait::kNone;
      resume(l, t);
    }
    bool all_done = true;
    for (const Thread &t : l.threads) all_done = all_done && t.done;
    if (all_done) break;
    if (!any || !l.progress) {
      char msg[200];
      std::snprintf(msg, sizeof msg, "deadlock in CTA (%u, %u, %u): no thread can go on", l.bidx.x, l.bidx.y,
                    l.bidx.z);
      die(msg);
    }
  }
  for (const Thread &t : l.threads)
    if (!t.open_group.empty() || !t.groups.empty()) die("a thread exited with cp.async copies not waited for");
  for (const auto &kv : l.copies)
    if (!kv.second.empty()) die("a CTA exited with bulk copies in flight");
}

// Dies with `what` unless [address, address + bytes) is `align`-aligned shared memory (a
// static __shared__ array's size is not known: only its alignment is checked).
void check_shared(uint32_t address, uint64_t bytes, uint32_t align, const char *what) {
  if (address % align != 0 || (address < kStaticShared && address + bytes > L().smem_bytes)) die(what);
}

Mbar &mbar_at(uint32_t bar) {
  check_shared(bar, 8, 8, "an mbarrier outside shared memory or misaligned");
  std::map<uint32_t, Mbar> &mbars = L().mbars;
  auto it = mbars.find(bar);
  if (it == mbars.end()) die("an mbarrier used before mbarrier.init");
  return it->second;
}

void mbar_complete_if_done(Mbar &m) {
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1u;
    m.pending = m.count;
    L().progress = true;
  }
}

void land(const PendingCopy &c) {
  if (c.src == nullptr) std::memset(shared_pointer(c.dst), 0, c.bytes);
  else std::memcpy(shared_pointer(c.dst), c.src, c.bytes);
}
// A bulk copy lands and completes its bytes on its barrier.
void land(const PendingCopy &c, uint32_t bar) {
  land(c);
  Mbar &m = mbar_at(bar);
  m.tx -= c.bytes;
  mbar_complete_if_done(m);
}

uint32_t shuffle(Op op, uint32_t v, uint32_t arg) {
  Thread &t = self();
  Warp &w = L().warps[t.warp];
  w.in[t.lane][0] = v;
  w.in[t.lane][1] = arg;
  return arrive(op).out[t.lane][0];
}

uint32_t half_bits(__half h) {
  __half_raw r = h;
  return r.x;
}
float half_value(uint32_t bits) {
  __half_raw r;
  r.x = uint16_t(bits);
  return __half2float(__half(r));
}

}  // namespace

void launch(dim3 grid, dim3 block, size_t smem_bytes, CopyLanding landing, const std::function<void()> &thread_body) {
  if (g_launch != nullptr) die("nested launch");
  Launch l;
  l.grid = grid;
  l.block = block;
  std::vector<uint8_t> smem(smem_bytes + 128);
  l.smem = smem.data() + (128 - reinterpret_cast<uintptr_t>(smem.data()) % 128) % 128;
  l.smem_bytes = smem_bytes;
  l.landing = landing;
  l.body = &thread_body;
  const uint32_t n = block.x * block.y * block.z;
  l.threads.resize(n);
  l.warps.resize((n + 31) / 32);
  l.wgmma_a.resize(n);
  std::vector<std::unique_ptr<FiberStack>> &stacks = fiber_stacks();
  while (stacks.size() < n) stacks.push_back(std::make_unique<FiberStack>());
  for (uint32_t i = 0; i < n; ++i) {
    Thread &t = l.threads[i];
    t.stack = stacks[i].get();
    t.tid = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    t.warp = i / 32;
    t.lane = i % 32;
  }
  g_launch = &l;
  for (uint32_t z = 0; z < grid.z; ++z)
    for (uint32_t y = 0; y < grid.y; ++y)
      for (uint32_t x = 0; x < grid.x; ++x) {
        l.bidx = make_uint3(x, y, z);
        run_cta(l);
      }
  g_launch = nullptr;
}

const uint3 &thread_idx() { return self().tid; }
const uint3 &block_idx() { return L().bidx; }
const dim3 &block_dim() { return L().block; }
const dim3 &grid_dim() { return L().grid; }
uint8_t *shared_base() { return L().smem; }
uint32_t shared_address(const void *p) {
  Launch &l = L();
  const uint8_t *b = static_cast<const uint8_t *>(p);
  if (b >= l.smem && b <= l.smem + l.smem_bytes) return uint32_t(b - l.smem);
  if (g_static_anchor == nullptr) g_static_anchor = b;
  const int64_t off = b - g_static_anchor;
  if (off < -(int64_t(1) << 29) || off >= (int64_t(1) << 29)) die("static __shared__ arrays too far apart to map");
  return uint32_t(int64_t(kStaticShared) + (int64_t(1) << 29) + off);
}
uint8_t *shared_pointer(uint32_t address) {
  Launch &l = L();
  if (address < kStaticShared) return l.smem + address;
  return const_cast<uint8_t *>(g_static_anchor) + (int64_t(address) - int64_t(kStaticShared) - (int64_t(1) << 29));
}

void syncwarp() { arrive(Op::kSyncwarp); }
void syncthreads() {
  Launch &l = L();
  ++l.cta_arrived;
  const uint64_t gen = l.cta_gen;
  cta_barrier_check();
  if (l.cta_gen == gen) block(Thread::Wait::kCta, gen);
}
uint32_t shfl(uint32_t v, int src_lane) { return shuffle(Op::kShfl, v, uint32_t(src_lane)); }
uint32_t shfl_xor(uint32_t v, int lane_mask) { return shuffle(Op::kShflXor, v, uint32_t(lane_mask)); }
uint32_t shfl_down(uint32_t v, int delta) { return shuffle(Op::kShflDown, v, uint32_t(delta)); }
uint32_t shfl_up(uint32_t v, int delta) { return shuffle(Op::kShflUp, v, uint32_t(delta)); }
uint32_t match_any(uint32_t v) { return shuffle(Op::kMatchAny, v, 0); }
uint32_t ballot(bool predicate) { return shuffle(Op::kBallot, predicate ? 1u : 0u, 0); }
void ldmatrix_x4(uint32_t (&r)[4], const void *smem, bool trans) {
  Launch &l = L();
  Thread &t = self();
  const uint8_t *p = static_cast<const uint8_t *>(smem);
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0 || (p >= l.smem && p + 16 > l.smem + l.smem_bytes))
    die("ldmatrix: a row address past shared memory or not 16-byte aligned");
  l.warps[t.warp].addr[t.lane] = p;
  Warp &w = arrive(trans ? Op::kLdmatrixTrans : Op::kLdmatrix);
  for (int i = 0; i < 4; ++i) r[i] = w.out[t.lane][i];
}
void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1, bool bf16) {
  Thread &t = self();
  Warp &w0 = L().warps[t.warp];
  for (int i = 0; i < 4; ++i) {
    w0.in[t.lane][i] = a[i];
    w0.fin[t.lane][i] = d[i];
  }
  w0.in[t.lane][4] = b0;
  w0.in[t.lane][5] = b1;
  Warp &w = arrive(bf16 ? Op::kMmaBF16 : Op::kMmaF16);
  for (int i = 0; i < 4; ++i) d[i] = w.fout[t.lane][i];
}

void mbar_init(uint32_t bar, uint32_t count) {
  Launch &l = L();
  check_shared(bar, 8, 8, "mbarrier.init outside shared memory or misaligned");
  Mbar m;
  m.count = m.pending = count;
  l.mbars[bar] = m;
}
void mbar_arrive_expect_tx(uint32_t bar, uint32_t bytes) {
  Mbar &m = mbar_at(bar);
  m.tx += bytes;
  if (m.pending == 0) die("mbarrier: more arrivals than its count in one phase");
  --m.pending;
  mbar_complete_if_done(m);
}
void mbar_arrive(uint32_t bar) {
  Mbar &m = mbar_at(bar);
  if (m.pending == 0) die("mbarrier: more arrivals than its count in one phase");
  --m.pending;
  mbar_complete_if_done(m);
}
void mbar_wait(uint32_t bar, uint32_t parity) {
  Launch &l = L();
  for (;;) {
    if (l.landing == CopyLanding::kAtWait) {
      auto it = l.copies.find(bar);
      if (it != l.copies.end()) {
        std::vector<PendingCopy> pending;
        pending.swap(it->second);
        for (const PendingCopy &c : pending) land(c, bar);
      }
    }
    if (mbar_at(bar).phase != (parity & 1u)) return;
    block(Thread::Wait::kSpin, 0);
  }
}
void bulk_copy(uint32_t dst, const void *src, uint32_t bytes, uint32_t bar) {
  Launch &l = L();
  if (bytes % 16 != 0 || reinterpret_cast<uintptr_t>(src) % 16 != 0) die("cp.async.bulk: size or source not a multiple of 16");
  check_shared(dst, bytes, 16, "cp.async.bulk: destination past shared memory or misaligned");
  mbar_at(bar);
  const PendingCopy c{dst, bytes, src};
  if (l.landing == CopyLanding::kAtIssue) land(c, bar);
  else l.copies[bar].push_back(c);
}

void cp_async(uint32_t dst, const void *src, uint32_t bytes, bool valid) {
  check_shared(dst, bytes, bytes, "cp.async: destination outside shared memory or misaligned");
  if (valid && reinterpret_cast<uintptr_t>(src) % bytes != 0) die("cp.async: source misaligned");
  const PendingCopy c{dst, bytes, valid ? src : nullptr};
  if (L().landing == CopyLanding::kAtIssue) land(c);
  else self().open_group.push_back(c);
}
void cp_async_commit() {
  Thread &t = self();
  t.groups.push_back(std::move(t.open_group));
  t.open_group.clear();
}
void cp_async_wait(int newest_pending) {
  Thread &t = self();
  while (t.groups.size() > size_t(newest_pending)) {
    for (const PendingCopy &c : t.groups.front()) land(c);
    t.groups.pop_front();
  }
}

// One arrival at barrier `id` of `count` threads; true when it completes the barrier.
bool barrier_arrive(uint32_t id, uint32_t count) {
  Launch &l = L();
  if (++l.named_arrived[id] != count) return false;
  l.named_arrived[id] = 0;
  ++l.named_gen[id];
  l.progress = true;
  return true;
}
void barrier_sync(uint32_t id, uint32_t count) {
  const uint64_t gen = L().named_gen[id];
  if (barrier_arrive(id, count)) return;
  self().wait_bar = id;
  block(Thread::Wait::kNamed, gen);
}
// A kernel's bar.sync / bar.arrive operands: ids 0-15, whole warps of the CTA.
void check_named(uint32_t id, uint32_t count, const char *what) {
  if (id >= 16 || count == 0 || count % 32 != 0 || count > L().threads.size()) die(what);
}
void named_barrier(uint32_t id, uint32_t count) {
  check_named(id, count, "bar.sync: bad id or count");
  barrier_sync(id, count);
}
void named_arrive(uint32_t id, uint32_t count) {
  check_named(id, count, "bar.arrive: bad id or count");
  barrier_arrive(id, count);
}

namespace {
struct EmuTensorMap {
  uint64_t magic;
  const uint8_t *base;
  uint64_t dims[3], strides[2];
  uint32_t box[3], elem_bytes, swizzle_128b;
};
constexpr uint64_t kTensorMapMagic = 0x7e45'0e3a'9b1c'd2f1ull;
static_assert(sizeof(EmuTensorMap) <= sizeof(CUtensorMap), "the emulation's tensor map fits a CUtensorMap");

uint32_t swizzle_128b(uint32_t address) { return address ^ (((address >> 7) & 7u) << 4); }

double operand_value(uint32_t bits, bool bf16) {
  if (bf16) {
    const uint32_t f = bits << 16;
    float x;
    std::memcpy(&x, &f, 4);
    return x;
  }
  return half_value(bits);
}
}  // namespace

void encode_tensor_map(void *map, const void *base, uint32_t elem_bytes, const uint64_t (&dims)[3],
                       const uint64_t (&strides)[2], const uint32_t (&box)[3], bool swizzle) {
  EmuTensorMap m{};
  m.magic = kTensorMapMagic;
  m.base = static_cast<const uint8_t *>(base);
  for (int i = 0; i < 3; ++i) {
    m.dims[i] = dims[i];
    m.box[i] = box[i];
  }
  m.strides[0] = strides[0];
  m.strides[1] = strides[1];
  m.elem_bytes = elem_bytes;
  m.swizzle_128b = swizzle ? 1 : 0;
  if ((uint64_t(box[0]) * elem_bytes) % 16 != 0 || (swizzle && uint64_t(box[0]) * elem_bytes != 128))
    die("tensor map: a box row must be a multiple of 16 bytes (128 with the 128-byte swizzle)");
  std::memset(map, 0, sizeof(CUtensorMap));
  std::memcpy(map, &m, sizeof m);
}

void tma_load_3d(uint32_t dst, const void *map, uint32_t bar, int c0, int c1, int c2) {
  Launch &l = L();
  EmuTensorMap m;
  std::memcpy(&m, map, sizeof m);
  if (m.magic != kTensorMapMagic) die("cp.async.bulk.tensor: not a tensor map of encode_tensor_map");
  const uint32_t row_bytes = m.box[0] * m.elem_bytes, per_chunk = 16 / m.elem_bytes;
  check_shared(dst, uint64_t(row_bytes) * m.box[1] * m.box[2], m.swizzle_128b ? 1024 : 128,
               "cp.async.bulk.tensor: destination past shared memory or misaligned");
  mbar_at(bar);
  for (uint32_t b2 = 0; b2 < m.box[2]; ++b2)
    for (uint32_t b1 = 0; b1 < m.box[1]; ++b1)
      for (uint32_t j = 0; j < row_bytes / 16; ++j) {
        uint32_t at = dst + (b2 * m.box[1] + b1) * row_bytes + 16 * j;
        if (m.swizzle_128b) at = swizzle_128b(at);
        const int64_t x0 = int64_t(c0) + int64_t(j) * per_chunk, x1 = int64_t(c1) + b1, x2 = int64_t(c2) + b2;
        const bool in = x0 >= 0 && x0 + per_chunk <= int64_t(m.dims[0]) && x1 >= 0 && x1 < int64_t(m.dims[1]) &&
                        x2 >= 0 && x2 < int64_t(m.dims[2]);
        const PendingCopy c{at, 16, in ? m.base + x2 * m.strides[1] + x1 * m.strides[0] + x0 * m.elem_bytes : nullptr};
        if (l.landing == CopyLanding::kAtIssue) land(c, bar);
        else l.copies[bar].push_back(c);
      }
}

void wgmma(float *d, uint32_t n, const uint32_t *a, uint64_t desc_a, uint64_t desc_b, bool accumulate,
           bool b_mn_major, bool bf16) {
  Launch &l = L();
  Thread &t = self();
  const uint32_t tid = 32 * t.warp + t.lane, group = tid / 128;
  if ((desc_b >> 62) != 1 || (a == nullptr && (desc_a >> 62) != 1))
    die("wgmma: only 128-byte-swizzled shared-memory operands are emulated");
  if (l.threads.size() < 128 * (group + 1)) die("wgmma: a warpgroup of fewer than 128 threads");
  if (a != nullptr) l.wgmma_a[tid] = {a[0], a[1], a[2], a[3]};
  barrier_sync(16 + group, 128);  // every thread's A fragment is in
  struct Desc {
    uint32_t start, lbo, sbo;
  };
  auto decode = [](uint64_t desc) {
    return Desc{uint32_t(desc & 0x3FFF) << 4, uint32_t((desc >> 16) & 0x3FFF) << 4, uint32_t((desc >> 32) & 0x3FFF) << 4};
  };
  const Desc da = decode(desc_a), db = decode(desc_b);
  PendingWgmma op{d, std::vector<float>(n / 2), a, {}, {}};
  if (a != nullptr) std::memcpy(op.a_bits.data(), a, sizeof op.a_bits);
  auto smem_value = [&](uint32_t address) {
    const uint32_t at = swizzle_128b(address);
    check_shared(at, 2, 2, "wgmma: an operand outside shared memory");
    uint16_t bits;
    std::memcpy(&bits, shared_pointer(at), 2);
    op.smem_read.emplace_back(at, bits);
    return operand_value(bits, bf16);
  };
  auto a_at = [&](uint32_t row, uint32_t k) {
    if (a == nullptr) return smem_value(da.start + (row / 8) * da.sbo + (row % 8) * 128 + 2 * k);
    const uint32_t rr = row % 16, lane = 4 * (rr % 8) + (k % 8) / 2, reg = rr / 8 + 2 * (k / 8);
    return operand_value(l.wgmma_a[128 * group + 32 * (row / 16) + lane][reg] >> (16 * (k % 2)) & 0xffffu, bf16);
  };
  auto b_at = [&](uint32_t k, uint32_t col) {
    return smem_value(b_mn_major ? db.start + (col / 64) * db.lbo + (k / 8) * db.sbo + (k % 8) * 128 + 2 * (col % 64)
                                 : db.start + (col / 8) * db.sbo + (col % 8) * 128 + 2 * k);
  };
  // The accumulator's value as issued: a pending product into the same registers (the
  // hardware chains those in issue order), else d itself.
  const float *in = d;
  auto find_in = [&](const std::vector<PendingWgmma> &ops) {
    for (const PendingWgmma &op : ops) {
      if (op.d == d && op.result.size() == n / 2) in = op.result.data();
      else if (op.d < d + n / 2 && d < op.d + op.result.size()) die("wgmma: accumulators overlap a pending product's");
    }
  };
  for (const std::vector<PendingWgmma> &g : t.wg_groups) find_in(g);
  find_in(t.wg_open);
  const uint32_t w = (tid / 32) % 4, lane = t.lane;
  for (uint32_t e = 0; e < n / 2; ++e) {
    const uint32_t i = e / 4, r = (e / 2) % 2, c = e % 2;
    const uint32_t row = 16 * w + lane / 4 + 8 * r, col = 8 * i + 2 * (lane % 4) + c;
    double s = accumulate ? in[e] : 0.0;
    for (uint32_t k = 0; k < 16; ++k) s += a_at(row, k) * b_at(k, col);
    op.result[e] = float(s);
  }
  t.wg_open.push_back(std::move(op));
  std::fill(d, d + n / 2, std::numeric_limits<float>::quiet_NaN());  // unreadable until the wait
  barrier_sync(16 + group, 128);  // every thread is past its reads of the A fragments
}

void wgmma_commit() {
  Thread &t = self();
  t.wg_groups.push_back(std::move(t.wg_open));
  t.wg_open.clear();
}

void wgmma_wait(int newest_pending) {
  Thread &t = self();
  if (t.wg_groups.size() <= size_t(newest_pending)) return;
  // Every other thread gets a turn first: what they do while the products are in flight (a
  // stage released too early and refilled) shows in the checks below.
  block(Thread::Wait::kSpin, 0);
  L().progress = true;
  while (t.wg_groups.size() > size_t(newest_pending)) {
    for (const PendingWgmma &op : t.wg_groups.front()) {
      if (op.a != nullptr && std::memcmp(op.a, op.a_bits.data(), sizeof op.a_bits) != 0)
        die("wgmma: its A registers changed before the wgmma.wait_group that covers it");
      for (const auto &[at, bits] : op.smem_read) {
        uint16_t now;
        std::memcpy(&now, shared_pointer(at), 2);
        if (now != bits) die("wgmma: a shared-memory operand changed before the wgmma.wait_group that covers it");
      }
      std::copy(op.result.begin(), op.result.end(), op.d);
    }
    t.wg_groups.pop_front();
  }
}

uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const double x = double(half_value(a >> (16 * h))) * double(half_value(b >> (16 * h)));
    r |= half_bits(__double2half(x)) << (16 * h);
  }
  return r;
}
uint32_t hfms2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r = 0;
  for (int h = 0; h < 2; ++h) {
    const double x = double(half_value(a >> (16 * h))) * double(half_value(b >> (16 * h))) -
                     double(half_value(c >> (16 * h)));
    r |= half_bits(__double2half(x)) << (16 * h);
  }
  return r;
}

}  // namespace emulation
}  // namespace minikv
