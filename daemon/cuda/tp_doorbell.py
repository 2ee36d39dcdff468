"""A TP group on the doorbell transport: one resolve per engine and index group for every
rank of the group, on the device (DESIGN §5.6).

The ranks of a TP engine ring their own bells with their own blocks, as any doorbell rank
does. Once every rank of the group has attached (all on one GPU), the leader's (rank 0's)
doorbell stream takes a step graph of the whole group, captured once: it waits for every
member's step bell, checks each follower's STEP block against its own
(``skv_tp_check_step``: a "bad" word per follower), begins the step once on the group's
residency (the leader's), then per index group waits for every member's bell, resolves the
leader's TOPK block once, hands each follower the leader's slots where its rows are the
leader's (``skv_tp_follow``: a differing row is refused, TP_MISMATCH in the follower's error
record), and puts the plan's rows into every member's slab, each member's ready words after
its own rows (a refused follower's slab gets every row too: every slab mirrors the shared
residency, or a later hit of that rank would read a stale row): striped when every slab is
in the daemon's layout (member r gathers stripe r of each row's misses from the pool, then
pushes it into the other members' slabs, so the pool is read once for the group), else
each member gathers the whole plan. With prefetch, the leader's prefetch plan goes into
every slab by whole gathers. Followers' streams run nothing.

A member that leaves (detach, death) stops the group: the leader's stream is drained
(every member's bells rung from the host) before any member's memory is given back; the
engine's other ranks are then served no more (their streams wait on their ready words
until they detach). Ranks on several GPUs are refused for now (their slabs would be
written over peer access from the leader's GPU; the striped gather, each GPU fetching a
share over its own link, is the design: docs/DESIGN.md §5.6).
"""

from __future__ import annotations

import logging

import numpy as np

from sparsekv.proto.stream_ops import wait32, write32

from ..residency.base import ResidencyError

log = logging.getLogger("sparsekv.cuda")

CHECK_THREADS = 256


class TpDoorbellGroup:
    """The device side of one TP engine's ``TpGroup`` on the doorbell transport.

    Args:
        size: the group's ranks.
        kernels: the GPU's kernel cache (``tp.cu``).
    """

    def __init__(self, size: int, kernels):
        self.size = size
        self.kernels = kernels
        self.members: dict[int, object] = {}  # rank -> CudaRankState
        self.started = False
        self.stopped = False
        self._bad = None  # uint32 [size]: a follower's step differed from the leader's
        self._targets = None  # [r][q]: member r's push target for member q's slab (striped gathers), or None
        self._drained: bool | None = None  # once stopped: whether the leader's stream drained

    def add(self, rank: int, state) -> None:
        """Rank ``rank``'s CudaRankState (doorbell transport, not started) joins; the group
        starts once every rank has."""
        if self.stopped:
            raise ResidencyError("BAD_ARGUMENT", "this TP group stopped (a rank left): restart every rank of the "
                                 "engine to form a new one")
        if self.members:
            first = next(iter(self.members.values()))
            if first.worker is not state.worker:
                raise ResidencyError("BAD_ARGUMENT", "the ranks of a TP group on the doorbell transport must share "
                                     f"one GPU for now (rank {rank} is on GPU {state.worker.ordinal}, the group's on "
                                     f"GPU {first.worker.ordinal})")
        self.members[rank] = state
        state.tp_device = self
        if len(self.members) == self.size:
            self._start()

    def _start(self) -> None:
        import cupy as cp

        leader = self.members[0]
        followers = [self.members[r] for r in range(1, self.size)]
        with cp.cuda.Device(leader.worker.ordinal):  # (the kernel cache's modules are per current device)
            # A memset, not a CuPy kernel: a kernel's first use loads a module, which waits
            # for every stream of the GPU (another engine's parked doorbell stream too).
            stream = leader.transport.stream
            self._bad = cp.empty(self.size, dtype=cp.uint32)
            cp.cuda.runtime.memsetAsync(self._bad.data.ptr, 0, self._bad.nbytes, stream.ptr)
            for f in followers:  # their arrival counters were zeroed on their own streams, which run nothing else
                f.transport.stream.synchronize()
            self._targets = self._stripe_targets()
            self._check_step = self.kernels.function("tp.cu", "skv_tp_check_step", {})
            self._follow = self.kernels.function("tp.cu", "skv_tp_follow", {})
        leader.transport.bells_extra = [a for f in followers for a in f.transport.bell_addresses]
        leader.transport.start(self._enqueue_step)
        self.started = True

    def _enqueue_step(self, stream) -> None:
        """The group's step on the leader's stream (captured once)."""
        i32 = np.int32
        lead = self.members[0]
        followers = [self.members[r] for r in range(1, self.size)]
        lt, lb, ld = lead.transport, lead.buffers, lead.dstep
        B, K = lb.max_batch, lead.dstep.layout.top_k
        inv_cap = ld.residency.inv_cap
        bad = [self._bad.data.ptr + 4 * r for r in range(self.size)]
        for m in (lead, *followers):
            address = m.transport.bell_addresses[0]
            wait32(stream.ptr, address, 1)
            write32(stream.ptr, address, 0)
        with stream:
            for r, f in enumerate(followers, 1):
                self._check_step((1,), (CHECK_THREADS,),
                                 (lb.db_step.block, f.buffers.db_step.block, i32(B), i32(inv_cap), np.uint64(bad[r]),
                                  f.buffers.err))
        ld.residency.launch_begin_step(lb.db_step.desc, lb.db_step.rows, lb.db_step.aux, lb.db_step.payload, lb.err,
                                       B, stream)
        groups = ld.layout.groups
        for g, layers in enumerate(groups):
            lead_bell = lt.bell_addresses[1 + g]
            wait32(stream.ptr, lead_bell, 1)
            for f in followers:
                address = f.transport.bell_addresses[1 + g]
                wait32(stream.ptr, address, 1)
                write32(stream.ptr, address, 0)
            t = lb.db_topk[g]
            ld.enqueue_resolve(t, lb.db_slots[g], lb.db_misses[g], stream, clear=lead_bell)
            with stream:
                for r, f in enumerate(followers, 1):
                    self._follow((B,), (CHECK_THREADS,),
                                 (t.block, f.buffers.db_topk[g].block, lb.db_slots[g], lb.db_misses[g],
                                  f.buffers.db_slots[g], f.buffers.db_misses[g], i32(K), i32(B), np.uint64(bad[r]),
                                  f.buffers.err))
            if g == len(groups) - 1:
                for m in (lead, *followers):
                    m.dstep.enqueue_stats_out(stream)
            for layer in layers:
                self._gather_layer(layer, t.desc, lb.plan_rows, lb.plan_slots, lb.db_misses[g], B, stream)
            if lb.prefetch and g + 1 < len(groups):
                # The residency's prefetch, its rows into the leader's slab; its counters go out
                # with the last group's (after every prefetch of the step).
                ld.enqueue_prefetch(t, stream, stats_out=False)
                for f in followers:
                    f.mover.launch_gather(t.desc, lb.pf_rows, lb.pf_slots, lb.pf_counts, B, stream,
                                          group_layers=f.buffers.pf_layers)

    def _gather_layer(self, layer: int, desc, plan_rows, plan_slots, misses, max_batch: int, stream) -> None:
        """The group's plan into every member's slab for ``layer``, each member's ready word
        once its rows are in. Striped (``self._targets``): member r gathers stripe r of the
        plan from the pool into its own slab, then pushes it into every other member's slab
        (device-to-device): the pool is read once, not once a member; a member's ready word
        counts its own gather's blocks and the others' pushes (``size`` x blocks). Else each
        member gathers the whole plan."""
        members = [self.members[r] for r in range(self.size)]
        ready = [m.transport.ready_addresses[layer] for m in members]
        arrivals = [m.transport.arrivals.data.ptr + 4 * layer for m in members]
        # Every launch into the leader's slab comes last: once the leader's last ready word of
        # a step is set, its engine may write its next step's top-k block (this ``desc``, with
        # one index group) while launches after it would still read it.
        if self._targets is None:
            for r in (*range(1, self.size), 0):
                m = members[r]
                m.mover.launch_gather(desc, plan_rows, plan_slots, misses, max_batch, stream,
                                      group_layers=m.buffers.db_layers[layer], ready=ready[r], arrivals=arrivals[r])
            return
        n, expect = self.size, self.size * members[0].mover.blocks
        for r, m in enumerate(members):
            m.mover.launch_gather(desc, plan_rows, plan_slots, misses, max_batch, stream,
                                  group_layers=m.buffers.db_layers[layer], ready=ready[r], arrivals=arrivals[r],
                                  stripe=r, stripes=n, expect=expect)
        for q in (*range(1, n), 0):  # (after every gather on this stream: each stripe is in its slab)
            for r, m in enumerate(members):
                if q != r:
                    m.mover.launch_push(desc, plan_rows, plan_slots, misses, max_batch, stream, self._targets[r][q],
                                        stripe=r, stripes=n, group_layers=m.buffers.db_layers[layer],
                                        ready=ready[q], arrivals=arrivals[q], expect=expect)

    def _stripe_targets(self) -> list | None:
        """Each member's view of every other member's slab (``launch_push`` destinations),
        when the group can stripe its gathers: every member's slab in the daemon's layout (a
        push reads its source slab so), all on one GPU with the same gather grid; else None."""
        members = [self.members[r] for r in range(self.size)]
        movers = [m.mover for m in members]
        if any(mv.engine_owned for mv in movers) or len({mv.blocks for mv in movers}) != 1:
            return None
        return [[mv.slab_target(movers[q].slab) if q != r else None for q in range(self.size)]
                for r, mv in enumerate(movers)]

    def stop(self) -> bool:
        """Stop serving the group: every member's stop word set (its engine's indices are -1
        from then on, and its handle releases its stream), then the leader's stream drained
        (every member's bells rung: the graphs it still runs read stale blocks). False when
        it did not drain (nothing of any member may be freed then), on every later call too."""
        if self._drained is not None:
            return self._drained
        self.stopped = True
        if not self.started:
            self._drained = True
            return True
        import cupy as cp

        with cp.cuda.Device(self.members[0].worker.ordinal):
            side = cp.cuda.Stream(non_blocking=True)  # (stream memory operations only: no module load)
            for m in self.members.values():
                write32(side.ptr, m.transport.stop_address, 1)
            side.synchronize()
        for m in self.members.values():  # the handles' watchers read these (after the device words)
            m.buffers.host_stop[0] = 1
        self._drained = self.members[0].transport.close()
        if not self._drained:
            log.error("the TP group's doorbell stream did not drain; its ranks' memory stays allocated")
        return self._drained

    def remove(self, rank: int) -> bool:
        """Rank ``rank`` leaves: a group serving stops first (its stream reads every member's
        memory); before it started, the rank just goes (it may attach again)."""
        if not self.started and not self.stopped:
            self.members.pop(rank, None)
            return True
        ok = self.stop()
        self.members.pop(rank, None)
        return ok
