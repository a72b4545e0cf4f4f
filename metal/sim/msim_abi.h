// metal/sim ABI shared by the runtime (msim_runtime.h, compiled once) and
// every generated kernel library (metal_sim.h + the kernel body).
//
// Plain C layout only: both sides are built by the same g++, but they are
// separate shared objects and the Python side fills some of these structs
// with ctypes (see metal/sim/_native.py, keep the two in sync and bump
// MSIM_ABI_VERSION on any change).
#pragma once

#include <stddef.h>
#include <stdint.h>

#define MSIM_ABI_VERSION 4

#ifdef __cplusplus
extern "C" {
#endif

typedef struct msim_uint3 {
  uint32_t x, y, z;
} msim_uint3;

// Every attribute MLX may put in a kernel signature ([[thread_position_in_grid]]
// and friends); the generated entry picks the ones the body names.
typedef struct msim_thread_attrs {
  msim_uint3 thread_position_in_grid;
  msim_uint3 thread_position_in_threadgroup;
  msim_uint3 threadgroup_position_in_grid;
  msim_uint3 threads_per_threadgroup;  // actual size of this (maybe edge) group
  msim_uint3 dispatch_threads_per_threadgroup;  // requested size
  msim_uint3 threadgroups_per_grid;
  msim_uint3 threads_per_grid;  // == grid_size
  msim_uint3 grid_origin;
  uint32_t thread_index_in_threadgroup;
  uint32_t thread_index_in_simdgroup;
  uint32_t simdgroup_index_in_threadgroup;
  uint32_t simdgroups_per_threadgroup;
  uint32_t dispatch_simdgroups_per_threadgroup;
  uint32_t threads_per_simdgroup;
  uint32_t thread_execution_width;
  uint32_t thread_index_in_quadgroup;
  uint32_t quadgroup_index_in_threadgroup;
  uint32_t quadgroups_per_threadgroup;
  uint32_t dispatch_quadgroups_per_threadgroup;
} msim_thread_attrs;

// One kernel argument ([[buffer(i)]]). `ptr` is what the kernel's pointer
// points at (element 0 of the argument); bytes [lo, hi) relative to `ptr`
// may be accessed (lo <= 0: strided views may start before element 0).
typedef struct msim_buffer {
  void* ptr;
  int64_t lo;
  int64_t hi;
  const char* name;
  uint32_t itemsize;  // bytes per element (for element indices in reports)
  uint32_t writable;  // an output: the race checker tracks accesses to it
} msim_buffer;

// Memory the race checker watches, read by the kernel library's access hooks
// (metal_sim.h, MSIM_RACECHECK) before they call msim_api.access: accesses
// outside both windows (stacks, inputs below or above every output) are
// dropped without a call.
typedef struct msim_race_window {
  uintptr_t tg_lo, tg_hi;    // threadgroup memory of the running group
  uintptr_t dev_lo, dev_hi;  // envelope of the writable buffers
} msim_race_window;

// Rendezvous kinds for simd_sync.
enum { MSIM_SYNC_SIMD = 0, MSIM_SYNC_SIMD_BARRIER = 1, MSIM_SYNC_QUAD = 2 };

// Bytes one lane may contribute to a SIMD-group exchange (float4x2, int64x4...).
#define MSIM_LANE_BYTES 64

// Functions the runtime gives the kernel library (no symbol lookup across
// the two .so files, so nothing depends on RTLD_GLOBAL).
typedef struct msim_api {
  int abi_version;
  // Blocks the calling thread until every live lane of its SIMD-group (or
  // quad, for MSIM_SYNC_QUAD) is blocked; lanes blocked at the same call site
  // form the active set. Returns the active-lane mask (bit i = lane i of the
  // SIMD-group) and sets *lanes to 32 slots of MSIM_LANE_BYTES bytes holding
  // each active lane's `value`; *lane is the caller's lane (0..31).
  uint32_t (*simd_sync)(int kind, const void* value, uint32_t size,
                        const char* file, uint32_t line, uint32_t col,
                        const unsigned char** lanes, uint32_t* lane);
  // threadgroup_barrier: returns once every thread of the threadgroup waits
  // at this barrier; reports a deadlock otherwise (never returns then).
  // `flags` are Metal's mem_flags bits (1 device, 2 threadgroup).
  void (*barrier)(const char* file, uint32_t line, uint32_t col, int flags);
  // Per-threadgroup storage for `threadgroup T name[...]` declaration `slot`
  // (elem_size: bytes of its innermost element, for reports).
  void* (*tg_alloc)(uint32_t slot, uint64_t size, uint64_t align,
                    const char* name, uint32_t elem_size);
  // Out-of-bounds access to argument/threadgroup array `name`: element
  // `index` (of the accessed type) outside [lo, hi); never returns.
  void (*oob)(const char* name, int64_t index, int64_t lo, int64_t hi);
  // Any other kernel-side error; never returns.
  void (*fail)(const char* msg);
  // Race checker: null when off, else the windows worth reporting to
  // `access` (a load or store of `size` bytes at `addr` by the running
  // thread; `pc` is the kernel code that made it). Reports a race (never
  // returns then) or records the access.
  const volatile msim_race_window* race;
  void (*access)(const void* addr, uint32_t size, int is_write, const void* pc);
} msim_api;

typedef void (*msim_kernel_fn)(const msim_api* api,
                               const msim_thread_attrs* attrs,
                               const msim_buffer* buffers);

// Error codes returned by msim_dispatch (message in err).
enum {
  MSIM_OK = 0,
  MSIM_ERR_OOB = 1,
  MSIM_ERR_DEADLOCK = 2,
  MSIM_ERR_FAULT = 3,
  MSIM_ERR_TIMEOUT = 4,
  MSIM_ERR_CONFIG = 5,
  MSIM_ERR_KERNEL = 6,
  MSIM_ERR_RACE = 7,
};

// Thread schedules: the order in which runnable simulated threads (and
// threadgroups) are run. Values >= MSIM_SCHED_RANDOM are seeded shuffles.
enum { MSIM_SCHED_FORWARD = 0, MSIM_SCHED_REVERSE = 1, MSIM_SCHED_RANDOM = 2 };

typedef struct msim_launch {
  msim_kernel_fn fn;
  const msim_buffer* buffers;
  uint32_t nbuffers;
  uint32_t schedule;   // MSIM_SCHED_*
  int racecheck;       // track threadgroup/writable-buffer accesses (the
                       // kernel library must be built with the hooks)
  uint32_t grid[3];
  uint32_t threadgroup[3];
  uint64_t stack_bytes;   // per simulated thread
  double timeout_s;       // <= 0: no watchdog
  int poison_threadgroup; // fill threadgroup memory with 0xFF bytes
  uint32_t max_threadgroup_bytes;
  char* err;
  uint64_t err_len;
} msim_launch;

#ifdef __cplusplus
}
#endif
