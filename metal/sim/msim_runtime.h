// metal/sim runtime: runs one kernel dispatch on the CPU.
//
// Compiled once (as C++) into its own shared library by metal/sim/_native.py;
// kernel libraries never include this file. Entry point: msim_dispatch().
//
// Model: every threadgroup of the grid runs in turn on the calling OS thread.
// Within a threadgroup each simulated thread is a fiber with its own stack
// (a small assembly context switch on x86-64 Linux, ucontext elsewhere or
// with -DMSIM_USE_UCONTEXT; ucontext costs two syscalls per switch). A fiber runs until it reaches a rendezvous (threadgroup_barrier, a
// SIMD-group function, simdgroup_barrier) or finishes. When no fiber can run,
// the scheduler
//   1. completes every pending SIMD-group operation: within a SIMD-group the
//      lanes blocked at the same call site are that operation's active lanes
//      (this is how divergent lanes behave on the GPU: lanes in the other
//      branch are inactive), then
//   2. releases a threadgroup barrier once every thread of the group waits at
//      that same barrier, or reports a deadlock (threads finished or waiting
//      at another barrier) instead of hanging.
// Faults (SIGSEGV/SIGBUS/SIGFPE/SIGILL, fiber stack overflow included) and an
// optional wall-clock watchdog abandon the dispatch with an error message
// instead of killing the process or hanging it.
//
// Schedules: runnable fibers (and threadgroups) run in index order, reverse
// order, or a seeded shuffle (msim_launch.schedule), so a kernel whose result
// depends on thread order shows it when run under two schedules.
//
// Race checker (msim_launch.racecheck; the kernel library calls api_access
// for its loads and stores, see metal_sim.h): per threadgroup, every byte of
// threadgroup memory and of the writable (output) buffers remembers its last
// writer and up to two readers, each with the barrier epoch of its access.
// An epoch counts the threadgroup_barriers whose mem_flags cover that memory
// (mem_threadgroup / mem_device); per SIMD-group, a second epoch counts its
// simdgroup_barriers with those flags, which order accesses of threads of
// that SIMD-group only. Two accesses by different threads, at least one a
// write, in the same epoch are a data race on the GPU whatever order the
// emulator ran them in; the first one found stops the dispatch with both
// threads and both code addresses (turned into source lines in Python), as
// CUDA's racecheck reports hazards. Atomic functions are not tracked.
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "msim_abi.h"

#if defined(__x86_64__) && defined(__linux__) && !defined(MSIM_USE_UCONTEXT)
#define MSIM_FAST_SWITCH 1
// Saves callee-saved registers, MXCSR and the x87 control word on the current
// stack, stores the stack pointer in *save, and resumes the context whose
// stack pointer is `to` (System V x86-64 ABI).
extern "C" void msim_switch(void** save, void* to);
asm(R"(
    .text
    .globl msim_switch
    .hidden msim_switch
    .type msim_switch,@function
msim_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size msim_switch, .-msim_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");
#else
#define MSIM_FAST_SWITCH 0
#endif

namespace {

struct Context {
#if MSIM_FAST_SWITCH
  void* sp = nullptr;
#else
  ucontext_t uc;
#endif
};

enum ThreadState { T_RUNNABLE, T_AT_SIMD, T_AT_BARRIER, T_DONE };

struct SimThread {
  Context ctx;
  msim_thread_attrs attrs;
  ThreadState state;
  int kind;
  const char* file;
  uint32_t line, col;
  const void* value;
  uint32_t size;
  uint32_t mask;
  int flags;  // mem_flags of the barrier it waits at
};

// Race checker: one access remembered for a byte of watched memory.
struct Access {
  int32_t tid = -1;    // thread_index_in_threadgroup; -1: none
  uint32_t ep = 0;     // threadgroup epoch of that memory space at the access
  uint32_t sgep = 0;   // the thread's SIMD-group epoch at the access
  const void* pc = nullptr;
};
struct Cell {
  uint32_t gen = 0;  // threadgroup run that wrote this cell; older: empty
  Access w;          // last write
  Access r[2];       // reads since (two distinct threads suffice to report)
  Access pw;         // pending write-write pair: the earlier write,
  uint8_t pbyte = 0; //   the value it left,
  bool pending = false;  // and whether the pair awaits its value check
};
enum { SPACE_TG = 0, SPACE_DEV = 1 };

struct TgVar {
  uint32_t slot;
  uint64_t size;
  uint64_t offset;
  const char* name;
  uint32_t elem_size;
};

struct Sched {
  const msim_launch* L = nullptr;
  Context main_ctx;
  std::vector<SimThread> threads;
  int nthreads = 0;  // threads in the current threadgroup
  int cur = -1;
  char* stack_map = nullptr;
  size_t stack_map_len = 0;
  size_t stack_stride = 0;
  std::vector<unsigned char> lanes;  // [simdgroup][32][MSIM_LANE_BYTES]
  std::vector<unsigned char> tg_mem;
  uint64_t tg_used = 0;
  std::vector<TgVar> tg_vars;
  msim_uint3 tg_pos{0, 0, 0};
  std::vector<int> order;  // fiber run order for this round
  uint64_t rng = 0;
  // race checker
  bool race = false;
  msim_race_window window{};
  uint32_t ep[2] = {0, 0};           // per space: threadgroup barrier epochs
  std::vector<uint32_t> sg_ep[2];    // per space, per SIMD-group
  std::vector<const msim_buffer*> writable;
  std::vector<std::pair<int, uintptr_t>> pending;  // write-write pairs to settle
  int err_code = MSIM_OK;
  std::string err;
  sigjmp_buf fault_jmp;
  volatile sig_atomic_t in_kernel = 0;
  volatile sig_atomic_t timed_out = 0;
};

thread_local Sched* g_sched = nullptr;
// The running dispatch for the kernel-side api (dispatches run one at a time;
// a plain global spares the hot paths a TLS lookup from this shared library).
// The signal handler keeps using g_sched to tell our faults from others'.
Sched* g_run = nullptr;

// Fiber side: suspend this thread and resume the scheduler.
inline void to_scheduler(Context& self, Context& main) {
#if MSIM_FAST_SWITCH
  msim_switch(&self.sp, main.sp);
#else
  swapcontext(&self.uc, &main.uc);
#endif
}

// Fiber side: leave for good (the fiber is never resumed).
[[noreturn]] inline void abandon_to_scheduler(Context& main) {
#if MSIM_FAST_SWITCH
  void* dead;
  msim_switch(&dead, main.sp);
#else
  setcontext(&main.uc);
#endif
  abort();  // unreachable
}

// Scheduler side: run a fiber until it blocks, finishes or fails.
inline void to_fiber(Context& main, Context& fiber) {
#if MSIM_FAST_SWITCH
  msim_switch(&main.sp, fiber.sp);
#else
  swapcontext(&main.uc, &fiber.uc);
#endif
}

const int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
constexpr int kNumFaultSignals = 4;
int watchdog_signal() { return SIGRTMIN + 4; }

std::string fmt(const char* f, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, f);
  vsnprintf(buf, sizeof(buf), f, ap);
  va_end(ap);
  return buf;
}

std::string describe_thread(const SimThread& t) {
  const auto& a = t.attrs;
  return fmt(
      "thread_position_in_grid=(%u,%u,%u), thread_position_in_threadgroup="
      "(%u,%u,%u), threadgroup_position_in_grid=(%u,%u,%u)",
      a.thread_position_in_grid.x, a.thread_position_in_grid.y,
      a.thread_position_in_grid.z, a.thread_position_in_threadgroup.x,
      a.thread_position_in_threadgroup.y, a.thread_position_in_threadgroup.z,
      a.threadgroup_position_in_grid.x, a.threadgroup_position_in_grid.y,
      a.threadgroup_position_in_grid.z);
}

std::string site(const char* file, uint32_t line, uint32_t col) {
  return fmt("%s:%u:%u", file ? file : "?", line, col);
}

// Stop the current fiber for good and return to the scheduler.
[[noreturn]] void fail_current(int code, const std::string& msg) {
  Sched* s = g_sched;
  if (s->err_code == MSIM_OK) {
    s->err_code = code;
    s->err = msg;
    if (s->cur >= 0) {
      s->err += " [" + describe_thread(s->threads[s->cur]) + "]";
    }
  }
  abandon_to_scheduler(s->main_ctx);
}

// ---------------------------------------------------------------- api -----

uint32_t api_simd_sync(int kind, const void* value, uint32_t size,
                       const char* file, uint32_t line, uint32_t col,
                       const unsigned char** lanes, uint32_t* lane) {
  Sched* s = g_run;
  SimThread& t = s->threads[s->cur];
  if (size > MSIM_LANE_BYTES) {
    fail_current(MSIM_ERR_KERNEL,
                 fmt("SIMD-group operation at %s on a %u-byte value (the "
                     "simulator supports up to %d bytes)",
                     site(file, line, col).c_str(), size, MSIM_LANE_BYTES));
  }
  t.state = T_AT_SIMD;
  t.kind = kind;
  t.file = file;
  t.line = line;
  t.col = col;
  t.value = value;
  t.size = size;
  to_scheduler(t.ctx, s->main_ctx);
  uint32_t sg = t.attrs.simdgroup_index_in_threadgroup;
  *lanes = s->lanes.data() + (size_t)sg * 32 * MSIM_LANE_BYTES;
  *lane = t.attrs.thread_index_in_simdgroup;
  return t.mask;
}

void api_barrier(const char* file, uint32_t line, uint32_t col, int flags) {
  Sched* s = g_run;
  SimThread& t = s->threads[s->cur];
  t.state = T_AT_BARRIER;
  t.file = file;
  t.line = line;
  t.col = col;
  t.flags = flags;
  to_scheduler(t.ctx, s->main_ctx);
}

// ------------------------------------------------------- race checker -----

// Shadow of threadgroup memory (one Cell per byte; a Cell from an earlier
// threadgroup run is empty) and of the writable buffers (per byte, cleared
// for every threadgroup). Dispatches run one at a time, so these are shared.
std::vector<Cell> g_tg_shadow;
struct Cells4 {
  Cell c[4];
};
std::unordered_map<uintptr_t, Cells4> g_dev_shadow;  // key: address / 4
uint32_t g_gen = 0;

const char* kMemFlag[2] = {"mem_flags::mem_threadgroup", "mem_flags::mem_device"};

// "{{pc:0x...}}": a code address inside the kernel library as an offset
// from its load address (kernel.py turns it into a source line).
std::string pc_mark(const void* pc) {
  Dl_info info;
  if (pc && dladdr(pc, &info) && info.dli_fbase) {
    return fmt("{{pc:0x%llx}}",
               (unsigned long long)((const char*)pc - (const char*)info.dli_fbase));
  }
  return fmt("{{pc:?%p}}", pc);
}

std::string thread_short(const SimThread& t) {
  const auto& a = t.attrs;
  return fmt("thread %u (thread_position_in_threadgroup=(%u,%u,%u), "
             "simdgroup %u, thread_position_in_grid=(%u,%u,%u))",
             a.thread_index_in_threadgroup, a.thread_position_in_threadgroup.x,
             a.thread_position_in_threadgroup.y,
             a.thread_position_in_threadgroup.z,
             a.simdgroup_index_in_threadgroup, a.thread_position_in_grid.x,
             a.thread_position_in_grid.y, a.thread_position_in_grid.z);
}

// True if `o` (an access by another thread) is ordered before an access by
// thread `tid` now: a barrier of the right kind ran in between.
inline bool ordered(const Sched* s, int space, const Access& o, int tid) {
  if (o.ep != s->ep[space]) return true;
  int sg = tid / 32;
  return o.tid / 32 == sg && o.sgep != s->sg_ep[space][sg];
}

// Describes a race between access `a` (by another thread, earlier in the
// emulator's order) and `b`; sets the dispatch error (first one wins).
void set_race(Sched* s, int space, uintptr_t addr, const Access& a,
              bool a_write, const Access& b, bool b_write) {
  if (s->err_code != MSIM_OK) return;
  std::string what;
  if (space == SPACE_TG) {
    uintptr_t off = addr - s->window.tg_lo;
    what = fmt("threadgroup memory at byte %llu", (unsigned long long)off);
    for (const TgVar& v : s->tg_vars) {
      if (off >= v.offset && off < v.offset + v.size) {
        uint64_t rel = off - v.offset;
        uint32_t es = v.elem_size ? v.elem_size : 1;
        what = fmt("threadgroup array '%s' (flat element %llu)", v.name,
                   (unsigned long long)(rel / es));
        break;
      }
    }
  } else {
    what = fmt("device memory at %p", (void*)addr);
    for (const msim_buffer* b : s->writable) {
      uintptr_t base = (uintptr_t)b->ptr;
      if (addr >= base + b->lo && addr < base + b->hi) {
        int64_t rel = (int64_t)(addr - base);
        int64_t es = b->itemsize ? b->itemsize : 1;
        what = fmt("device buffer '%s' (element %lld)", b->name ? b->name : "?",
                   (long long)(rel >= 0 ? rel / es : -((-rel + es - 1) / es)));
        break;
      }
    }
  }
  const char* kind = a_write ? (b_write ? "write-write, different values"
                                        : "read-after-write")
                             : "write-after-read";
  s->err_code = MSIM_ERR_RACE;
  s->err = fmt(
      "data race (%s) on %s in threadgroup (%u,%u,%u): %s %s it at %s; %s %s "
      "it at %s; no threadgroup_barrier(%s) (nor, within one SIMD-group, "
      "simdgroup_barrier(%s)) separates the two accesses",
      kind, what.c_str(), s->tg_pos.x, s->tg_pos.y, s->tg_pos.z,
      thread_short(s->threads[a.tid]).c_str(), a_write ? "writes" : "reads",
      pc_mark(a.pc).c_str(), thread_short(s->threads[b.tid]).c_str(),
      b_write ? "writes" : "reads", pc_mark(b.pc).c_str(), kMemFlag[space],
      kMemFlag[space]);
}

// A write-write pair is a race only if the values differ (many threads
// storing the same value, e.g. all lanes zeroing one element, is harmless on
// the GPU). The store happens after its hook, so the check is deferred to
// the cell's next access, the next barrier or the end of the threadgroup.
// Returns false (error set) for a race.
bool settle(Sched* s, int space, Cell& c, uintptr_t addr) {
  if (!c.pending) return true;
  c.pending = false;
  if (*(const volatile uint8_t*)addr == c.pbyte) return true;
  set_race(s, space, addr, c.pw, true, c.w, true);
  return false;
}

Cell* cell_at(Sched* s, int space, uintptr_t addr) {
  if (space == SPACE_TG) {
    if (addr < s->window.tg_lo || addr >= s->window.tg_hi) return nullptr;
    Cell& c = g_tg_shadow[addr - s->window.tg_lo];
    return c.gen == g_gen ? &c : nullptr;
  }
  auto it = g_dev_shadow.find(addr >> 2);
  return it == g_dev_shadow.end() ? nullptr : &it->second.c[addr & 3];
}

// Settles every deferred write-write pair; false (error set) on a race.
bool settle_all(Sched* s) {
  bool ok = true;
  for (const auto& p : s->pending) {
    Cell* c = cell_at(s, p.first, p.second);
    if (c && ok) ok = settle(s, p.first, *c, p.second);
  }
  s->pending.clear();
  return ok;
}

[[noreturn]] void abandon_race() {
  Sched* s = g_run;
  abandon_to_scheduler(s->main_ctx);
}

// One access `now` (by thread now.tid, this epoch) to the byte at `addr`.
inline void track_byte(Sched* s, int space, Cell& c, uintptr_t addr,
                       bool write, const Access& now) {
  int tid = now.tid;
  if (c.gen != g_gen) {
    c = Cell();
    c.gen = g_gen;
  } else if (write && c.w.tid == tid && c.r[0].tid < 0 && c.r[1].tid < 0 &&
             !c.pending) {
    c.w = now;  // a thread rewriting its own data: nothing to check
    return;
  }
  if (c.pending && !settle(s, space, c, addr)) abandon_race();
  if (c.w.tid >= 0 && c.w.tid != tid && !ordered(s, space, c.w, tid)) {
    if (!write) {
      set_race(s, space, addr, c.w, true, now, false);
      abandon_race();
    }
    c.pending = true;
    c.pw = c.w;
    c.pbyte = *(const volatile uint8_t*)addr;  // the other thread's value
    s->pending.emplace_back(space, addr);
  }
  if (write) {
    for (const Access& r : c.r) {
      if (r.tid >= 0 && r.tid != tid && !ordered(s, space, r, tid)) {
        set_race(s, space, addr, r, false, now, true);
        abandon_race();
      }
    }
    c.w = now;
    c.r[0] = Access();
    c.r[1] = Access();
    return;
  }
  for (Access& r : c.r) {
    if (r.tid == tid) {
      r = now;
      return;
    }
  }
  for (Access& r : c.r) {
    if (r.tid < 0 || r.ep != now.ep) {  // empty, or ordered before all later accesses
      r = now;
      return;
    }
  }
  // Two other threads' reads are kept: enough to report any later writer.
}

void api_access(const void* addr, uint32_t size, int is_write, const void* pc) {
  Sched* s = g_run;
  if (s == nullptr || !s->race || s->cur < 0) return;
  uintptr_t a = (uintptr_t)addr;
  const msim_race_window& w = s->window;
  int tid = s->cur;
  if (a + size > w.tg_lo && a < w.tg_hi) {
    const Access now{tid, s->ep[SPACE_TG], s->sg_ep[SPACE_TG][tid / 32], pc};
    for (uint32_t i = 0; i < size; ++i) {
      uintptr_t x = a + i;
      if (x < w.tg_lo || x >= w.tg_hi) continue;
      track_byte(s, SPACE_TG, g_tg_shadow[x - w.tg_lo], x, is_write != 0, now);
    }
    return;
  }
  for (const msim_buffer* b : s->writable) {
    uintptr_t lo = (uintptr_t)b->ptr + b->lo, hi = (uintptr_t)b->ptr + b->hi;
    if (a + size <= lo || a >= hi) continue;
    const Access now{tid, s->ep[SPACE_DEV], s->sg_ep[SPACE_DEV][tid / 32], pc};
    Cells4* q = nullptr;
    uintptr_t qkey = 0;
    for (uint32_t i = 0; i < size; ++i) {
      uintptr_t x = a + i;
      if (x < lo || x >= hi) continue;
      if (q == nullptr || (x >> 2) != qkey) {
        qkey = x >> 2;
        q = &g_dev_shadow[qkey];
      }
      track_byte(s, SPACE_DEV, q->c[x & 3], x, is_write != 0, now);
    }
    return;
  }
}

void* api_tg_alloc(uint32_t slot, uint64_t size, uint64_t align,
                   const char* name, uint32_t elem_size) {
  Sched* s = g_run;
  for (const TgVar& v : s->tg_vars) {
    if (v.slot == slot) {
      if (v.size != size) {
        fail_current(MSIM_ERR_KERNEL,
                     fmt("threadgroup variable '%s' declared with %llu bytes "
                         "by one thread and %llu by another",
                         name, (unsigned long long)v.size,
                         (unsigned long long)size));
      }
      return s->tg_mem.data() + v.offset;
    }
  }
  if (align == 0) align = 1;
  uint64_t off = (s->tg_used + align - 1) / align * align;
  uint64_t limit = s->L->max_threadgroup_bytes;
  if (off + size > limit || off + size > s->tg_mem.size()) {
    fail_current(MSIM_ERR_KERNEL,
                 fmt("threadgroup memory: '%s' needs %llu bytes, total %llu "
                     "exceeds the %llu-byte limit",
                     name, (unsigned long long)size,
                     (unsigned long long)(off + size),
                     (unsigned long long)limit));
  }
  s->tg_vars.push_back(TgVar{slot, size, off, name, elem_size});
  s->tg_used = off + size;
  s->window.tg_hi = s->window.tg_lo + s->tg_used;
  return s->tg_mem.data() + off;
}

void api_oob(const char* name, int64_t index, int64_t lo, int64_t hi) {
  fail_current(MSIM_ERR_OOB,
               fmt("out-of-bounds access to '%s': element %lld, valid "
                   "elements are [%lld, %lld)",
                   name ? name : "?", (long long)index, (long long)lo,
                   (long long)hi));
}

void api_fail(const char* msg) { fail_current(MSIM_ERR_KERNEL, msg); }

msim_api kApi = {MSIM_ABI_VERSION, api_simd_sync, api_barrier, api_tg_alloc,
                 api_oob,          api_fail,      nullptr,     api_access};

// ---------------------------------------------------------- scheduler -----

void fiber_main() {
  Sched* s = g_sched;
  SimThread& t = s->threads[s->cur];
  s->L->fn(&kApi, &t.attrs, s->L->buffers);
  t.state = T_DONE;
#if MSIM_FAST_SWITCH
  abandon_to_scheduler(s->main_ctx);
#endif
  // (ucontext: uc_link returns to the scheduler)
}

void init_fiber(Sched* s, SimThread& t, char* lo, size_t size) {
#if MSIM_FAST_SWITCH
  // Initial frame as msim_switch leaves it: [mxcsr|fpucw][r15..rbp][ret];
  // `ret` enters fiber_main with the stack aligned as after a call.
  uintptr_t top = ((uintptr_t)(lo + size)) & ~(uintptr_t)15;
  uint64_t* sp = (uint64_t*)top;
  *--sp = 0;                          // fiber_main's (unused) return address
  *--sp = (uint64_t)(void*)fiber_main;  // popped by msim_switch's ret
  for (int r = 0; r < 6; ++r) *--sp = 0;  // rbp rbx r12 r13 r14 r15
  uint32_t csr[2];
  asm volatile("stmxcsr %0" : "=m"(csr[0]));
  asm volatile("fnstcw %0" : "=m"(csr[1]));
  --sp;
  memcpy(sp, csr, 8);
  t.ctx.sp = sp;
#else
  getcontext(&t.ctx.uc);
  t.ctx.uc.uc_stack.ss_sp = lo;
  t.ctx.uc.uc_stack.ss_size = size;
  t.ctx.uc.uc_link = &s->main_ctx.uc;
  makecontext(&t.ctx.uc, fiber_main, 0);
#endif
}

bool same_site(const SimThread& a, const SimThread& b) {
  return a.line == b.line && a.col == b.col && a.kind == b.kind &&
         (a.file == b.file || (a.file && b.file && !strcmp(a.file, b.file)));
}

// Complete pending SIMD-group operations; true if any thread became runnable.
bool resolve_simd(Sched* s) {
  bool progressed = false;
  int n = s->nthreads;
  for (int base = 0; base < n; base += 32) {
    int end = base + 32 < n ? base + 32 : n;
    uint32_t handled = 0;
    for (int i = base; i < end; ++i) {
      SimThread& ti = s->threads[i];
      if (ti.state != T_AT_SIMD || (handled >> (i - base) & 1u)) continue;
      int lo = base, hi = end;
      if (ti.kind == MSIM_SYNC_QUAD) {
        lo = base + ((i - base) & ~3);
        hi = lo + 4 < end ? lo + 4 : end;
      }
      uint32_t mask = 0;
      for (int j = lo; j < hi; ++j) {
        SimThread& tj = s->threads[j];
        if (tj.state == T_AT_SIMD && !(handled >> (j - base) & 1u) &&
            same_site(ti, tj)) {
          if (tj.size != ti.size) {
            s->cur = j;
            s->err_code = MSIM_ERR_KERNEL;
            s->err = fmt("SIMD-group operation at %s called with %u-byte and "
                         "%u-byte values by lanes of one SIMD-group",
                         site(ti.file, ti.line, ti.col).c_str(), ti.size,
                         tj.size);
            return false;
          }
          mask |= 1u << (j - base);
        }
      }
      unsigned char* slots =
          s->lanes.data() + (size_t)(base / 32) * 32 * MSIM_LANE_BYTES;
      int flags = 0;
      for (int j = lo; j < hi; ++j) {
        if (!(mask >> (j - base) & 1u)) continue;
        SimThread& tj = s->threads[j];
        if (tj.size) {
          memcpy(slots + (size_t)(j - base) * MSIM_LANE_BYTES, tj.value,
                 tj.size);
          if (tj.kind == MSIM_SYNC_SIMD_BARRIER && tj.size == sizeof(int)) {
            int f;
            memcpy(&f, tj.value, sizeof f);
            flags |= f;
          }
        }
        tj.mask = mask;
        tj.state = T_RUNNABLE;
      }
      if (s->race && ti.kind == MSIM_SYNC_SIMD_BARRIER) {
        // simdgroup_barrier(flags): orders this SIMD-group's accesses.
        if (flags & 2) s->sg_ep[SPACE_TG][base / 32]++;
        if (flags & 1) s->sg_ep[SPACE_DEV][base / 32]++;
      }
      handled |= mask;
      progressed = true;
    }
  }
  return progressed;
}

// All threads are blocked at barriers or done: release or report deadlock.
bool resolve_barrier(Sched* s) {
  int n = s->nthreads;
  int first = -1, waiting = 0, done = 0, other = -1, first_done = -1;
  int other_count = 0;
  for (int i = 0; i < n; ++i) {
    SimThread& t = s->threads[i];
    if (t.state == T_AT_BARRIER) {
      if (first < 0) {
        first = i;
        waiting++;
      } else if (same_site(s->threads[first], t)) {
        waiting++;
      } else {
        if (other < 0) other = i;
        other_count++;
      }
    } else if (t.state == T_DONE) {
      if (first_done < 0) first_done = i;
      done++;
    }
  }
  if (first < 0) return false;
  SimThread& f = s->threads[first];
  std::string where = site(f.file, f.line, f.col);
  if (other >= 0) {
    SimThread& o = s->threads[other];
    s->cur = other;
    s->err_code = MSIM_ERR_DEADLOCK;
    s->err = fmt("deadlock: threads of one threadgroup wait at different "
                 "threadgroup_barrier calls: %d at %s and %d at %s",
                 waiting, where.c_str(), other_count,
                 site(o.file, o.line, o.col).c_str());
    return false;
  }
  if (done > 0) {
    s->cur = first_done;
    s->err_code = MSIM_ERR_DEADLOCK;
    s->err = fmt("deadlock: threadgroup_barrier at %s is not reached by all "
                 "threads of the threadgroup: %d of %d threads wait there, "
                 "%d finished without reaching it (e.g. the thread below)",
                 where.c_str(), waiting, n, done);
    return false;
  }
  if (s->race && !settle_all(s)) return false;
  int flags = 0;
  for (int i = 0; i < n; ++i) {
    flags |= s->threads[i].flags;
    s->threads[i].state = T_RUNNABLE;
  }
  // threadgroup_barrier(flags): orders the memory those flags name.
  if (flags & 2) s->ep[SPACE_TG]++;
  if (flags & 1) s->ep[SPACE_DEV]++;
  return true;
}

void init_thread_attrs(Sched* s, const msim_uint3& tg, const msim_uint3& size,
                       const msim_uint3& groups) {
  const msim_launch* L = s->L;
  uint32_t n = size.x * size.y * size.z;
  uint32_t dispatch_n = L->threadgroup[0] * L->threadgroup[1] *
                        L->threadgroup[2];
  uint32_t i = 0;
  for (uint32_t z = 0; z < size.z; ++z)
    for (uint32_t y = 0; y < size.y; ++y)
      for (uint32_t x = 0; x < size.x; ++x, ++i) {
        msim_thread_attrs& a = s->threads[i].attrs;
        a.thread_position_in_threadgroup = {x, y, z};
        a.threadgroup_position_in_grid = tg;
        a.thread_position_in_grid = {tg.x * L->threadgroup[0] + x,
                                     tg.y * L->threadgroup[1] + y,
                                     tg.z * L->threadgroup[2] + z};
        a.threads_per_threadgroup = size;
        a.dispatch_threads_per_threadgroup = {
            L->threadgroup[0], L->threadgroup[1], L->threadgroup[2]};
        a.threadgroups_per_grid = groups;
        a.threads_per_grid = {L->grid[0], L->grid[1], L->grid[2]};
        a.grid_origin = {0, 0, 0};
        a.thread_index_in_threadgroup = i;
        a.thread_index_in_simdgroup = i % 32;
        a.simdgroup_index_in_threadgroup = i / 32;
        a.simdgroups_per_threadgroup = (n + 31) / 32;
        a.dispatch_simdgroups_per_threadgroup = (dispatch_n + 31) / 32;
        a.threads_per_simdgroup = 32;
        a.thread_execution_width = 32;
        a.thread_index_in_quadgroup = i % 4;
        a.quadgroup_index_in_threadgroup = i / 4;
        a.quadgroups_per_threadgroup = (n + 3) / 4;
        a.dispatch_quadgroups_per_threadgroup = (dispatch_n + 3) / 4;
      }
}

uint64_t next_random(Sched* s) {  // splitmix64
  uint64_t z = (s->rng += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// The order runnable fibers run in this round (msim_launch.schedule).
void make_order(Sched* s, int n) {
  uint32_t sched = s->L->schedule;
  for (int i = 0; i < n; ++i) {
    s->order[i] = sched == MSIM_SCHED_REVERSE ? n - 1 - i : i;
  }
  if (sched >= MSIM_SCHED_RANDOM) {
    for (int i = n - 1; i > 0; --i) {
      int j = (int)(next_random(s) % (uint64_t)(i + 1));
      int t = s->order[i];
      s->order[i] = s->order[j];
      s->order[j] = t;
    }
  }
}

// Runs one threadgroup; false on error (s->err set).
bool run_threadgroup(Sched* s, const msim_uint3& tg, const msim_uint3& groups) {
  const msim_launch* L = s->L;
  msim_uint3 size;
  size.x = L->grid[0] - tg.x * L->threadgroup[0];
  size.y = L->grid[1] - tg.y * L->threadgroup[1];
  size.z = L->grid[2] - tg.z * L->threadgroup[2];
  if (size.x > L->threadgroup[0]) size.x = L->threadgroup[0];
  if (size.y > L->threadgroup[1]) size.y = L->threadgroup[1];
  if (size.z > L->threadgroup[2]) size.z = L->threadgroup[2];
  int n = (int)(size.x * size.y * size.z);
  s->nthreads = n;
  s->tg_pos = tg;
  s->tg_vars.clear();
  s->tg_used = 0;
  if (L->poison_threadgroup) {
    memset(s->tg_mem.data(), 0xFF, s->tg_mem.size());
  }
  if (s->race) {
    ++g_gen;  // every shadow cell is now empty
    if (g_gen == 0) {  // (wrapped: clear for real)
      for (Cell& c : g_tg_shadow) c = Cell();
      g_gen = 1;
    }
    g_dev_shadow.clear();
    s->window.tg_lo = s->window.tg_hi = (uintptr_t)s->tg_mem.data();
    s->ep[0] = s->ep[1] = 0;
    for (auto& v : s->sg_ep) std::fill(v.begin(), v.end(), 0u);
  }
  init_thread_attrs(s, tg, size, groups);
  s->order.resize(n);
  for (int i = 0; i < n; ++i) {
    SimThread& t = s->threads[i];
    t.state = T_RUNNABLE;
    t.mask = 0;
    t.flags = 0;
    // Stacks grow down; the guard page sits at the low end of each slot.
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    init_fiber(s, t, s->stack_map + (size_t)i * s->stack_stride + page,
               s->stack_stride - page);
  }
  for (;;) {
    bool ran = false;
    make_order(s, n);
    for (int k = 0; k < n; ++k) {
      int i = s->order[k];
      if (s->threads[i].state != T_RUNNABLE) continue;
      ran = true;
      s->cur = i;
      to_fiber(s->main_ctx, s->threads[i].ctx);
      if (s->err_code != MSIM_OK) return false;
    }
    if (ran) continue;
    bool all_done = true;
    for (int i = 0; i < n; ++i) {
      if (s->threads[i].state != T_DONE) {
        all_done = false;
        break;
      }
    }
    if (all_done) break;
    if (!resolve_simd(s) && s->err_code == MSIM_OK && !resolve_barrier(s) &&
        s->err_code == MSIM_OK) {
      s->err_code = MSIM_ERR_DEADLOCK;
      s->err = "deadlock: no simulated thread can make progress";
    }
    if (s->err_code != MSIM_OK) {
      if (s->err_code != MSIM_ERR_RACE && s->cur >= 0 && s->cur < n) {
        s->err += " [" + describe_thread(s->threads[s->cur]) + "]";
      }
      return false;
    }
  }
  s->cur = -1;
  if (s->race && !settle_all(s)) return false;
  return true;
}

// ------------------------------------------------------------ signals -----

struct SignalGuard {
  struct sigaction old[kNumFaultSignals];
  struct sigaction old_watch;
  stack_t old_stack;
  std::vector<char> alt;
  bool installed = false;
};

void on_signal(int sig, siginfo_t* info, void*) {
  Sched* s = g_sched;
  if (s == nullptr || !s->in_kernel) {
    if (sig == watchdog_signal()) return;  // late watchdog: ignore
    signal(sig, SIG_DFL);  // not ours; let it fault again normally
    return;
  }
  s->in_kernel = 0;
  if (sig == watchdog_signal()) {
    s->err_code = MSIM_ERR_TIMEOUT;
    s->err = "timeout: the dispatch ran longer than its watchdog limit "
             "(infinite loop?)";
  } else {
    s->err_code = MSIM_ERR_FAULT;
    char* addr = info ? (char*)info->si_addr : nullptr;
    bool in_stacks = addr && s->stack_map && addr >= s->stack_map &&
                     addr < s->stack_map + s->stack_map_len;
    if (sig == SIGFPE) {
      s->err = "arithmetic fault (SIGFPE): integer division by zero or "
               "INT_MIN / -1 (undefined on the GPU)";
    } else if (in_stacks) {
      s->err = fmt("stack overflow of a simulated thread (%zu KiB stacks; "
                   "set KIMI_MLX_SIM_STACK_KB to raise)",
                   (s->stack_stride - (size_t)sysconf(_SC_PAGESIZE)) >> 10);
    } else if (sig == SIGILL) {
      s->err = "illegal instruction (SIGILL)";
    } else {
      s->err = fmt("invalid memory access (%s) at address %p: a raw pointer "
                   "(e.g. from &buf[i] or a cast) went outside its buffer",
                   sig == SIGBUS ? "SIGBUS" : "SIGSEGV", (void*)addr);
    }
  }
  if (s->cur >= 0 && s->cur < s->nthreads) {
    s->err += " [" + describe_thread(s->threads[s->cur]) + "]";
  }
  siglongjmp(s->fault_jmp, 1);
}

void install_signals(SignalGuard& g) {
  g.alt.resize(1 << 16);
  stack_t st;
  st.ss_sp = g.alt.data();
  st.ss_size = g.alt.size();
  st.ss_flags = 0;
  sigaltstack(&st, &g.old_stack);
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = on_signal;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
  sigemptyset(&sa.sa_mask);
  for (int i = 0; i < kNumFaultSignals; ++i) {
    sigaction(kFaultSignals[i], &sa, &g.old[i]);
  }
  sigaction(watchdog_signal(), &sa, &g.old_watch);
  g.installed = true;
}

void restore_signals(SignalGuard& g) {
  if (!g.installed) return;
  for (int i = 0; i < kNumFaultSignals; ++i) {
    sigaction(kFaultSignals[i], &g.old[i], nullptr);
  }
  sigaction(watchdog_signal(), &g.old_watch, nullptr);
  if (g.old_stack.ss_flags & SS_DISABLE) {
    stack_t st;
    memset(&st, 0, sizeof(st));
    st.ss_flags = SS_DISABLE;
    sigaltstack(&st, nullptr);
  } else {
    sigaltstack(&g.old_stack, nullptr);
  }
  g.installed = false;
}

struct Watchdog {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::thread th;

  void start(double seconds, pthread_t target, Sched* s) {
    th = std::thread([this, seconds, target, s] {
      std::unique_lock<std::mutex> lk(m);
      auto until = std::chrono::steady_clock::now() +
                   std::chrono::duration<double>(seconds);
      if (!cv.wait_until(lk, until, [this] { return done; })) {
        s->timed_out = 1;
        pthread_kill(target, watchdog_signal());
      }
    });
  }
  void stop() {
    if (!th.joinable()) return;
    {
      std::lock_guard<std::mutex> lk(m);
      done = true;
    }
    cv.notify_all();
    th.join();
  }
};

void set_err(const msim_launch* L, const std::string& msg) {
  if (L->err && L->err_len) {
    snprintf(L->err, L->err_len, "%s", msg.c_str());
  }
}

}  // namespace

extern "C" int msim_abi_version() { return MSIM_ABI_VERSION; }

// Runs the whole grid. Returns MSIM_OK or an MSIM_ERR_* code with the
// message in L->err. Never throws; never leaves signal handlers changed.
// Concurrent calls (from several Python threads) run one after another.
extern "C" int msim_dispatch(const msim_launch* L) {
  // Signal handlers are process-wide: one dispatch at a time.
  static std::mutex dispatch_mutex;
  std::lock_guard<std::mutex> one_at_a_time(dispatch_mutex);
  for (int d = 0; d < 3; ++d) {
    if (L->threadgroup[d] == 0) {
      set_err(L, "threadgroup dimensions must be positive");
      return MSIM_ERR_CONFIG;
    }
  }
  if (L->grid[0] == 0 || L->grid[1] == 0 || L->grid[2] == 0) return MSIM_OK;
  uint64_t tg_threads =
      (uint64_t)L->threadgroup[0] * L->threadgroup[1] * L->threadgroup[2];
  if (tg_threads > 1024) {
    set_err(L, fmt("threadgroup of %llu threads exceeds 1024",
                   (unsigned long long)tg_threads));
    return MSIM_ERR_CONFIG;
  }
  msim_uint3 groups = {(L->grid[0] + L->threadgroup[0] - 1) / L->threadgroup[0],
                       (L->grid[1] + L->threadgroup[1] - 1) / L->threadgroup[1],
                       (L->grid[2] + L->threadgroup[2] - 1) / L->threadgroup[2]};

  Sched* s = new Sched();
  Sched* prev = g_sched;
  g_sched = s;
  g_run = s;
  s->L = L;
  s->threads.resize(tg_threads);
  s->lanes.assign(((tg_threads + 31) / 32) * 32 * MSIM_LANE_BYTES, 0);
  s->tg_mem.assign(L->max_threadgroup_bytes ? L->max_threadgroup_bytes : 1, 0);
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t stack = L->stack_bytes ? (size_t)L->stack_bytes : (size_t)256 << 10;
  stack = (stack + page - 1) / page * page;
  s->stack_stride = stack + page;
  s->stack_map_len = s->stack_stride * tg_threads;
  void* m = mmap(nullptr, s->stack_map_len, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) {
    set_err(L, "could not map fiber stacks");
    g_sched = prev;
  g_run = nullptr;
    delete s;
    return MSIM_ERR_CONFIG;
  }
  s->stack_map = (char*)m;
  for (uint64_t i = 0; i < tg_threads; ++i) {
    mprotect(s->stack_map + i * s->stack_stride, page, PROT_NONE);
  }

  SignalGuard guard;
  Watchdog dog;
  install_signals(guard);
  if (L->timeout_s > 0) dog.start(L->timeout_s, pthread_self(), s);

  s->rng = 0x5DEECE66Dull * (L->schedule + 1);
  s->race = L->racecheck != 0;
  kApi.race = nullptr;
  if (s->race) {
    if (g_tg_shadow.size() < s->tg_mem.size()) g_tg_shadow.resize(s->tg_mem.size());
    uint32_t nsg = (uint32_t)((tg_threads + 31) / 32);
    s->sg_ep[0].assign(nsg, 0);
    s->sg_ep[1].assign(nsg, 0);
    uintptr_t dlo = UINTPTR_MAX, dhi = 0;
    for (uint32_t i = 0; i < L->nbuffers; ++i) {
      const msim_buffer& b = L->buffers[i];
      if (!b.writable || b.hi <= b.lo) continue;
      s->writable.push_back(&b);
      uintptr_t lo = (uintptr_t)b.ptr + b.lo, hi = (uintptr_t)b.ptr + b.hi;
      if (lo < dlo) dlo = lo;
      if (hi > dhi) dhi = hi;
    }
    s->window.dev_lo = dlo;
    s->window.dev_hi = dhi;
    s->window.tg_lo = s->window.tg_hi = (uintptr_t)s->tg_mem.data();
    kApi.race = &s->window;
  }
  // Threadgroups in order (x fastest), reversed, or shuffled with the threads.
  uint64_t ngroups = (uint64_t)groups.x * groups.y * groups.z;
  std::vector<uint64_t> tg_order;
  if (L->schedule >= MSIM_SCHED_RANDOM) {
    tg_order.resize(ngroups);
    for (uint64_t i = 0; i < ngroups; ++i) tg_order[i] = i;
    for (uint64_t i = ngroups; i > 1; --i) {
      uint64_t j = next_random(s) % i;
      std::swap(tg_order[i - 1], tg_order[j]);
    }
  }

  if (sigsetjmp(s->fault_jmp, 1) == 0) {
    s->in_kernel = 1;
    bool ok = true;
    for (uint64_t k = 0; ok && k < ngroups; ++k) {
      if (s->timed_out) {
        ok = false;
        s->err_code = MSIM_ERR_TIMEOUT;
        s->err = "timeout: the dispatch ran longer than its watchdog limit";
        break;
      }
      uint64_t g = L->schedule == MSIM_SCHED_REVERSE ? ngroups - 1 - k
                   : L->schedule >= MSIM_SCHED_RANDOM ? tg_order[k]
                                                      : k;
      msim_uint3 pos{(uint32_t)(g % groups.x),
                     (uint32_t)(g / groups.x % groups.y),
                     (uint32_t)(g / ((uint64_t)groups.x * groups.y))};
      if (!run_threadgroup(s, pos, groups)) ok = false;
    }
    s->in_kernel = 0;
  }
  kApi.race = nullptr;
  // (a fault or the watchdog lands here too, with err_code set)
  s->in_kernel = 0;
  dog.stop();
  restore_signals(guard);

  int code = s->err_code;
  if (code != MSIM_OK) set_err(L, s->err);
  munmap(s->stack_map, s->stack_map_len);
  g_sched = prev;
  g_run = nullptr;
  delete s;
  return code;
}
