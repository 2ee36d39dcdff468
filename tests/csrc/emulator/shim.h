// A CPU emulation of the CUDA features the sparsekv kernels use: each block runs as N
// fibers (ucontext) on one OS thread; barriers switch fibers. For checking only.
#pragma once
#include <ucontext.h>
#include <cstdint>
#include <cstring>
#include <vector>
#include <functional>
#include <cstdlib>
#include <cstdio>

struct EmuDim { unsigned x, y, z; };
struct EmuFiber { ucontext_t ctx; int state; int pred; unsigned mask; unsigned val, sum; char* stack; };
enum { RUN = 0, WAIT_BLOCK = 1, WAIT_WARP = 2, DONE = 3 };
extern EmuDim emu_tid3, emu_bid3, emu_bdim3, emu_gdim3;
extern std::vector<EmuFiber> emu_f;
extern int emu_cur;
extern ucontext_t emu_sched;
extern unsigned char* emu_dyn;

inline void emu_yield(int state) { emu_f[emu_cur].state = state; swapcontext(&emu_f[emu_cur].ctx, &emu_sched); }
inline EmuDim emu_threadIdx() { return EmuDim{(unsigned)emu_cur, 0, 0}; }
#define threadIdx (emu_threadIdx())
#define blockIdx (emu_bid3)
#define blockDim (emu_bdim3)
#define gridDim (emu_gdim3)
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static
#define SKV_DYN_SMEM(name) unsigned char* name = emu_dyn
inline void __syncthreads() { emu_f[emu_cur].pred = 0; emu_yield(WAIT_BLOCK); }
inline int __syncthreads_or(int p) { emu_f[emu_cur].pred = p ? 1 : 0; emu_yield(WAIT_BLOCK); return emu_f[emu_cur].pred; }
inline void __syncwarp(unsigned = 0xffffffffu) { emu_f[emu_cur].pred = 0; emu_yield(WAIT_WARP); }
inline unsigned __ballot_sync(unsigned, int p) { emu_f[emu_cur].pred = p ? 1 : 0; emu_yield(WAIT_WARP); return emu_f[emu_cur].mask; }
// val: this lane's addend; the warp's release sums the waiting lanes' (modulo 2^32)
inline unsigned __reduce_add_sync(unsigned, unsigned v) { emu_f[emu_cur].pred = 0; emu_f[emu_cur].val = v; emu_yield(WAIT_WARP); return emu_f[emu_cur].sum; }
inline int __reduce_add_sync(unsigned m, int v) { return (int)__reduce_add_sync(m, (unsigned)v); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline void __threadfence() {}
inline void __threadfence_block() {}
inline void __threadfence_system() {}
inline void __nanosleep(unsigned) { }
template <class T> inline T atomicAdd(T* a, T v) { T o = *a; *a = o + v; return o; }
template <class T> inline T atomicMin(T* a, T v) { T o = *a; if (v < o) *a = v; return o; }
template <class T> inline T atomicOr(T* a, T v) { T o = *a; *a = o | v; return o; }
template <class T> inline T atomicAnd(T* a, T v) { T o = *a; *a = o & v; return o; }
template <class T> inline T atomicExch(T* a, T v) { T o = *a; *a = v; return o; }
template <class T> inline T atomicAdd_system(T* a, T v) { return atomicAdd(a, v); }
template <class T> inline T atomicExch_system(T* a, T v) { return atomicExch(a, v); }
template <class T> inline T atomicCAS(T* a, T c, T v) { T o = *a; if (o == c) *a = v; return o; }

// 16-byte vectors and the read-only / streaming loads of the copy kernels.
struct uint4 { unsigned x, y, z, w; };
struct int4 { int x, y, z, w; };
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
