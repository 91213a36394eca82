#include "shim.h"
#include <ucontext.h>
#include <setjmp.h>
#include <vector>
#include <stdexcept>
#include <string>
#include <sys/mman.h>

namespace emu {
Idx g_thread, g_block, g_blockdim, g_griddim;

enum State { RUN, WAIT_BLOCK, WAIT_WARP, DONE };
struct Fiber {
  ucontext_t ctx;
  std::vector<char> stack;
  State state = RUN;
  std::source_location site;
  int warp_value = 0;
  bool started = false;
  jmp_buf jb;
};
static std::vector<Fiber> fibers;
static ucontext_t sched_ctx;
static jmp_buf sched_jb;
static int cur = 0;
static std::function<void()> body;
static int or_acc = 0, or_result = 0;
static std::vector<int> slots;
static std::vector<int> warp_round;  // generation per warp
long long n_switches = 0;
long long n_launches = 0, n_memsets = 0;
int errors = 0;
// The order the ready threads of a block run in between rendezvous points: thread 0 first, or the last first. A
// kernel that stores before a barrier what another thread loads after it (a missing __syncthreads) reads the stored
// value in one order or the other.
int reverse_order = 0;
// The order the blocks of a grid run in: (0, 0) first, or the last first. On a GPU any block may finish last; a
// kernel whose last-block-combines step assumed an order (the highest chunk last) shows in one of them.
int reverse_blocks = 0;

void fail(const char* what, const std::source_location& loc) {
  std::fprintf(stderr, "EMU ERROR: %s at %s:%u (block %u,%u thread %u)\n", what, loc.file_name(), loc.line(),
               g_block.x, g_block.y, g_thread.x);
  ++errors;
  throw std::runtime_error(what);
}

static void yield_to_sched() {
  ++n_switches;
  if (!_setjmp(fibers[cur].jb)) _longjmp(sched_jb, 1);
  g_thread = {static_cast<unsigned>(cur), 0, 0};
}

void block_wait(const std::source_location& loc, int pred, int* out) {
  Fiber& f = fibers[cur];
  or_acc |= pred;
  f.state = WAIT_BLOCK;
  f.site = loc;
  yield_to_sched();
  if (out) *out = or_result;
}

void warp_exchange(unsigned mask, const std::source_location& loc, int value, int src_lane, bool xor_mode, int* out) {
  if (mask != 0xffffffffu) fail("partial shfl mask not emulated", loc);
  const int me = cur;
  const int base = me & ~31;
  slots[me] = value;
  fibers[me].state = WAIT_WARP;
  fibers[me].site = loc;
  yield_to_sched();
  const int src = base + (xor_mode ? ((me & 31) ^ src_lane) : (src_lane & 31));
  *out = slots[src];
  fibers[me].state = WAIT_WARP;  // second rendezvous: nobody overwrites slots before all lanes read
  fibers[me].site = loc;
  yield_to_sched();
}

unsigned warp_ballot(unsigned mask, const std::source_location& loc, int pred) {
  if (mask != 0xffffffffu) fail("partial ballot mask not emulated", loc);
  const int me = cur;
  const int base = me & ~31;
  slots[me] = pred != 0;
  fibers[me].state = WAIT_WARP;
  fibers[me].site = loc;
  yield_to_sched();
  unsigned bits = 0;
  for (int l = 0; l < 32; ++l) bits |= static_cast<unsigned>(slots[base + l] != 0) << l;
  fibers[me].state = WAIT_WARP;  // second rendezvous: nobody overwrites slots before all lanes read
  fibers[me].site = loc;
  yield_to_sched();
  return bits;
}

// Dynamic shared memory: the launch's bytes at the end of a mapping whose next page is inaccessible (so a staging
// index past the launch's size faults), refilled with a pattern before each block (so a read of an element no thread
// of this block wrote shows up as garbage, not as the previous block's data).
static char* shared_map = nullptr;
static size_t shared_map_bytes = 0, shared_bytes_now = 0;
static char* shared_base = nullptr;

void* dynamic_shared() { return shared_base; }

static void map_shared(size_t bytes) {
  const size_t page = 4096;
  const size_t rounded = (bytes + 15) / 16 * 16;
  const size_t data_pages = (rounded + page - 1) / page;
  const size_t total = (data_pages + 1) * page;
  if (shared_map) munmap(shared_map, shared_map_bytes);
  shared_map = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (shared_map == MAP_FAILED) { std::perror("mmap"); std::abort(); }
  mprotect(shared_map + data_pages * page, page, PROT_NONE);
  shared_map_bytes = total;
  shared_base = shared_map + data_pages * page - rounded;
  shared_bytes_now = bytes;
}

static void entry() {
  try {
    body();
  } catch (...) {
  }
  fibers[cur].state = DONE;
  _longjmp(sched_jb, 1);
}

static bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && std::strcmp(a.file_name(), b.file_name()) == 0 && a.column() == b.column();
}

// Runs one block of n threads of body.
static void run_block(int n) {
  if (n % 32 != 0) { std::fprintf(stderr, "EMU: block size %d not a multiple of 32\n", n); std::abort(); }
  static std::vector<char*> pool;
  while (static_cast<int>(pool.size()) < n) pool.push_back(static_cast<char*>(std::malloc(128 * 1024)));
  fibers.resize(n);
  for (auto& f : fibers) { f.state = RUN; f.started = false; }
  slots.assign(n, 0);
  or_acc = or_result = 0;
  for (int i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = pool[i];
    f.ctx.uc_stack.ss_size = 128 * 1024;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, entry, 0);
  }
  for (;;) {
    bool ran = false;
    for (int k = 0; k < n; ++k) {
      const int i = reverse_order ? n - 1 - k : k;
      if (fibers[i].state != RUN) continue;
      cur = i;
      g_thread = {static_cast<unsigned>(i), 0, 0};
      ran = true;
      if (!_setjmp(sched_jb)) {
        if (!fibers[i].started) { fibers[i].started = true; swapcontext(&sched_ctx, &fibers[i].ctx); }
        else _longjmp(fibers[i].jb, 1);
      }
      if (errors) return;
    }
    // warps whose 32 lanes all wait at a shuffle: release
    bool released = false;
    for (int w = 0; w < n / 32; ++w) {
      int waiting = 0, done = 0;
      for (int l = 0; l < 32; ++l) {
        State s = fibers[w * 32 + l].state;
        waiting += s == WAIT_WARP;
        done += s == DONE;
      }
      if (waiting == 32) {
        for (int l = 1; l < 32; ++l)
          if (!same_site(fibers[w * 32].site, fibers[w * 32 + l].site)) {
            std::fprintf(stderr, "EMU ERROR: warp %d lanes shuffle at different sites (%u vs %u)\n", w,
                         fibers[w * 32].site.line(), fibers[w * 32 + l].site.line());
            ++errors; return;
          }
        for (int l = 0; l < 32; ++l) fibers[w * 32 + l].state = RUN;
        released = true;
      } else if (waiting > 0 && done > 0) {
        std::fprintf(stderr, "EMU ERROR: full-mask shuffle at line %u with %d exited lanes in warp %d (block %u,%u)\n",
                     fibers[w * 32].site.line(), done, w, g_block.x, g_block.y);
        ++errors; return;
      }
    }
    int waiting = 0, done = 0, live = 0;
    for (auto& f : fibers) { waiting += f.state == WAIT_BLOCK; done += f.state == DONE; }
    live = n - done;
    if (waiting > 0 && waiting == live) {
      const Fiber* first = nullptr;
      for (auto& f : fibers) if (f.state == WAIT_BLOCK) { if (!first) first = &f; else if (!same_site(first->site, f.site)) {
        std::fprintf(stderr, "EMU ERROR: divergent __syncthreads (lines %u and %u)\n", first->site.line(), f.site.line());
        ++errors; return; } }
      if (done > 0) {
        std::fprintf(stderr, "EMU ERROR: __syncthreads at line %u with %d exited threads (block %u,%u)\n",
                     first->site.line(), done, g_block.x, g_block.y);
        ++errors; return;
      }
      or_result = or_acc;
      or_acc = 0;
      for (auto& f : fibers) if (f.state == WAIT_BLOCK) f.state = RUN;
      released = true;
    }
    if (done == n) return;
    if (!ran && !released) {
      std::fprintf(stderr, "EMU ERROR: deadlock in block %u,%u (waiting block %d, done %d)\n", g_block.x, g_block.y,
                   waiting, done);
      ++errors; return;
    }
  }
}

void launch(const std::function<void()>& kernel, dim3 grid, dim3 block, size_t shared_bytes) {
  // the limits of sm_80 / sm_90 without opt-in attributes: a launch past them fails on the device
  if (block.x == 0 || block.x > 1024 || block.y != 1 || block.z != 1 || grid.x == 0 || grid.x > 0x7fffffffu ||
      grid.y == 0 || grid.y > 65535 || grid.z != 1 || shared_bytes > 48 * 1024) {
    std::fprintf(stderr, "EMU ERROR: launch configuration grid (%u,%u,%u) block (%u,%u,%u) shared %zu bytes\n",
                 grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes);
    ++errors;
    return;
  }
  ++n_launches;
  if (shared_bytes) map_shared(shared_bytes);
  g_griddim = {grid.x, grid.y, grid.z};
  g_blockdim = {block.x, block.y, block.z};
  body = kernel;
  for (unsigned iy = 0; iy < grid.y && !errors; ++iy)
    for (unsigned ix = 0; ix < grid.x && !errors; ++ix) {
      const unsigned bx = reverse_blocks ? grid.x - 1 - ix : ix;
      const unsigned by = reverse_blocks ? grid.y - 1 - iy : iy;
      g_block = {bx, by, 0};
      if (shared_bytes) std::memset(shared_base, 0xA5, shared_bytes);
      run_block(static_cast<int>(block.x));
    }
}
}  // namespace emu

// cudaMemsetAsync on host memory (the kernels' workspace is host memory here), counted as a stream operation.
extern "C" cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t) {
  ++emu::n_memsets;
  std::memset(ptr, value, count);
  return cudaSuccess;
}
