#include "shim.h"
EmuDim emu_tid3, emu_bid3, emu_bdim3, emu_gdim3;
std::vector<EmuFiber> emu_f;
int emu_cur;
ucontext_t emu_sched;
unsigned char* emu_dyn;
static std::function<void()> emu_body;
static void emu_entry() { emu_body(); emu_f[emu_cur].state = DONE; swapcontext(&emu_f[emu_cur].ctx, &emu_sched); }

// Run `body` as grid x block fibers; dynamic shared memory of smem bytes per block.
void emu_launch(int grid, int block, int smem, std::function<void()> body) {
    emu_body = body;
    emu_gdim3 = {(unsigned)grid, 1, 1};
    emu_bdim3 = {(unsigned)block, 1, 1};
    std::vector<unsigned char> dyn(smem > 0 ? smem : 16);
    const size_t stack = 256 << 10;
    emu_f.assign(block, EmuFiber{});
    for (auto& f : emu_f) f.stack = (char*)malloc(stack);
    for (int b = 0; b < grid; ++b) {
        emu_bid3 = {(unsigned)b, 1, 1};
        memset(dyn.data(), 0xA5, dyn.size());
        emu_dyn = dyn.data();
        for (int t = 0; t < block; ++t) {
            EmuFiber& f = emu_f[t];
            getcontext(&f.ctx);
            f.ctx.uc_stack.ss_sp = f.stack;
            f.ctx.uc_stack.ss_size = stack;
            f.ctx.uc_link = nullptr;
            makecontext(&f.ctx, emu_entry, 0);
            f.state = RUN;
        }
        for (;;) {
            bool ran = false;
            for (int t = 0; t < block; ++t) {
                if (emu_f[t].state != RUN) continue;
                emu_cur = t;
                swapcontext(&emu_sched, &emu_f[t].ctx);
                ran = true;
            }
            if (ran) continue;
            // nobody runnable: release a warp barrier, else the block barrier, else done
            bool released = false;
            for (int w = 0; w * 32 < block; ++w) {
                int lo = w * 32, hi = lo + 32 < block ? lo + 32 : block;
                bool all = true, any = false;
                unsigned mask = 0, sum = 0;
                for (int t = lo; t < hi; ++t) {
                    if (emu_f[t].state == WAIT_WARP) {
                        any = true;
                        if (emu_f[t].pred) mask |= 1u << (t - lo);
                        sum += emu_f[t].val;
                    }
                    else if (emu_f[t].state != DONE) all = false;
                }
                if (any && all) {
                    for (int t = lo; t < hi; ++t) if (emu_f[t].state == WAIT_WARP) { emu_f[t].mask = mask; emu_f[t].sum = sum; emu_f[t].val = 0; emu_f[t].state = RUN; }
                    released = true;
                }
            }
            if (released) continue;
            bool all = true, any = false; int orv = 0;
            for (int t = 0; t < block; ++t) {
                if (emu_f[t].state == WAIT_BLOCK) { any = true; orv |= emu_f[t].pred; }
                else if (emu_f[t].state != DONE) all = false;
            }
            if (any && all) {
                for (int t = 0; t < block; ++t) if (emu_f[t].state == WAIT_BLOCK) { emu_f[t].pred = orv; emu_f[t].state = RUN; }
                continue;
            }
            bool done = true;
            for (int t = 0; t < block; ++t) if (emu_f[t].state != DONE) done = false;
            if (!done) { fprintf(stderr, "emu: deadlock in block %d\n", b); abort(); }
            break;
        }
    }
    for (auto& f : emu_f) free(f.stack);
}
