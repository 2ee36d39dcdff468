"""A cuda rank's memory: views into its GPU's arena (what the client opens through CUDA
IPC, and what the decode step's kernels read and write), the pinned host blocks its
transport fills, and the export the client receives at attach.

Arena layout of one rank (each section a 256-byte aligned range of the arena):

| section | shape | who writes / reads |
| --- | --- | --- |
| ``slab`` | uint8 ``[L, max_reqs, S, row_bytes]`` | gather / the engine's attention |
| ``staging`` | uint8 ``[L, staging_rows, row_bytes]`` | the client / stage, write mirror |
| ``slots``, ``misses`` | int32 ``[R, B, K]``, ``[R, B]`` | resolve / the client (ring entry) |
| ``step_block`` | int32 step block (below) | the transport / ``skv_begin_step`` |
| ``topk_block`` | int32 step block (below) | the transport / ``skv_resolve`` |
| ``plan_rows``, ``plan_slots`` | int32 ``[B, K]`` | resolve / gather |
| ``stats`` | uint64 ``[G, 4]`` then int32 ``[ERR_INTS]`` | kernels / copied to the host after each request |
| ``write_rows``, ``drop_rows`` | int32 ``[1 + staging_rows]`` | write path: count + rows in staging order / sorted |
| ``layers`` | int32 ``[L]`` | write path: the layers of a staged write |
| ``workspace`` | uint8 ``[B, resolve workspace]`` | resolve, when its workspace is too big for shared memory |
| ``db_step``, ``db_topk`` | int32 step block, ``[G]`` step blocks | doorbell: the engine's stream / the daemon's step graph |
| ``db_slots``, ``db_misses`` | int32 ``[G, B, K]``, ``[G, B]`` | doorbell: resolve / the engine's ``skv_db_indices`` |
| ``db_ctl`` | uint32 ``[1 + G + L + 1]`` | doorbell words: the step bell, a bell per group, a ready word per layer, the stop word (set when the rank's TP group stops: its indices -1) |
| ``done`` | uint32 ``[R]`` | zmq: per ring entry, the last device-wait TOPK whose result is in place |
| ``db_layers`` | int32 ``[L, G, 2]`` | doorbell: per layer, a group table naming only that layer (one gather per layer) |
| ``pf_rows``, ``pf_slots``, ``pf_counts`` | int32 ``[B, K]``, ``[B, K]``, ``[B]`` | prefetch: ``skv_prefetch`` / its gather (apart from the resolve's plan) |
| ``pf_layers`` | int32 ``[G, 1 + most layers of a group]`` | prefetch: row g names group g + 1's layers (the last row none) |
| ``pf_err`` | int32 ``[ERR_INTS]`` | prefetch: its error record, never read (below) |

Pinned host blocks (one memfd that the client maps too, registered; ``HostBlocks``): R STEP and R TOPK
blocks the daemon writes (requests whose arrays came on the socket), R STEP and R TOPK
blocks the client writes (it then sends a TOPK naming the entry: no array on the
socket), the stats mirror (with prefetch: and the prefetch counters' mirror), the write
path's blocks.

A **step block** (``proto/step_block.py``): the zmq transport writes one into pinned host
memory and ``skv_fetch`` copies it to the arena; a device transport writes the arena's.

B = ``layout.max_batch``, K = ``layout.top_k``, R = ``ring_depth``, G = index groups.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from sparsekv.proto.step_block import BlockView, block_ints

from ..memfd import new_memfd
from ..pinned import PinnedRegion
from ..residency.base import ResidencyError
from ..residency.cuda import COUNTERS_PER_GROUP, ERR_INTS, PF_COUNTERS
from .arena import ArenaFull
from .deferred import FreeFn, free_now


def prefetch_layers(layout) -> np.ndarray:
    """The prefetch gather's group table (``skv_gather``'s ``group_layers``): row g holds
    group g + 1's count and layers, the last row none. The prefetch's descriptor is group
    g's own top-k block (``skv_prefetch`` with ``group_offset`` 1), so the gather, which
    takes its row of the table from that descriptor, writes group g + 1's layers."""
    groups = layout.groups
    table = np.full((len(groups), 1 + max(len(g) for g in groups)), -1, np.int32)
    table[:, 0] = 0
    for g, layers in enumerate(groups[1:]):
        table[g, 0] = len(layers)
        table[g, 1: 1 + len(layers)] = layers
    return table


class HostBlocks:
    """Pinned, mapped host memory for a rank's transport: a memfd (the client maps it too
    and writes its step blocks there) registered with ``cudaHostRegister``. Owns the
    descriptor (``fd``), the mapping and the registration; :meth:`close` is idempotent.
    ``name``: the memfd's name (``memfd.new_memfd``); None: an anonymous mapping."""

    @staticmethod
    def size_for(nbytes: int) -> int:
        """The bytes a :class:`HostBlocks` of ``nbytes`` maps: whole pages."""
        return max(mmap.PAGESIZE, -(-int(nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE)

    def __init__(self, nbytes: int, name: str | None = None):
        self.nbytes = self.size_for(nbytes)
        self.fd = None
        if name is None:
            self._mm = mmap.mmap(-1, self.nbytes)
        else:
            self.fd = new_memfd(name, self.nbytes)  # no SIGBUS later: fails here
            try:
                self._mm = mmap.mmap(self.fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                self._close_fd()
                raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8)
        self.address = self.array.ctypes.data
        try:
            self._region = PinnedRegion(self.address, self.nbytes, 4)
        except BaseException:
            self.array = None
            self._mm.close()
            self._close_fd()
            raise
        self.device_address = self._region.device_base
        self._used = 0

    def reset(self) -> None:
        """Zeroed and empty again, for a new rank (``deferred.DeferredFrees.reuse``)."""
        self.array[:] = 0
        self._used = 0

    def take(self, nbytes: int, dtype, shape) -> tuple[np.ndarray, int]:
        """The next ``nbytes`` (256-aligned) as a host array and its device address."""
        off = self._used
        self._used = off + ((int(nbytes) + 255) & ~255)
        if self._used > self.nbytes:
            raise ValueError("host blocks overflow (sized wrong)")
        a = self.array[off: off + int(nbytes)].view(dtype).reshape(shape)
        return a, self.device_address + off

    def offset_of(self, a: np.ndarray) -> int:
        """Byte offset of a view from :meth:`take` in the file."""
        return a.ctypes.data - self.address

    def _close_fd(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)

    def close(self) -> None:
        if self._region is not None:
            self._region.close()
            self._region = None
            self.array = None
            try:
                self._mm.close()
            except BufferError:
                pass  # a view outlives us; the mapping goes with the process
            self._close_fd()


class RankBuffers:
    """Every device range of one rank, allocated in its GPU's arena, and the host blocks.

    Args:
        arena: the GPU's :class:`~sparsekv.daemon.cuda.arena.DeviceArena`.
        layout: the attached layout.
        ring_depth: result ring entries (requests a client may have in flight).
        workspace_bytes: per-batch-row global resolve workspace (0: shared memory).
        blocks_name: the memfd name of the pinned host blocks; None: anonymous (in process).
        doorbell: also the doorbell transport's rings and words (``db_*`` sections).
        own_slab: allocate the hot slab (False: the engine brings it; ``slab`` is None).
        prefetch: also the prefetch plan and its group table (``pf_*`` sections), and the
            host mirror of the prefetch counters (``host_pf``).
        make_host: ``(nbytes, name) -> HostBlocks`` (default: new ones; the cuda backend's
            may hand back a spare of the same owner, zeroed).
    """

    def __init__(self, arena, layout, ring_depth: int, workspace_bytes: int = 0, blocks_name: str | None = None,
                 doorbell: bool = False, own_slab: bool = True, prefetch: bool = False, make_host=HostBlocks):
        import cupy as cp

        lay = layout
        self.layout, self.arena, self.ring_depth = lay, arena, int(ring_depth)
        R, B, K, G = self.ring_depth, lay.max_batch, lay.top_k, lay.num_groups
        self.max_batch, self.block_ints = B, block_ints(B, K)
        self.stats_bytes = G * COUNTERS_PER_GROUP * 8 + ERR_INTS * 4
        self.own_slab = bool(own_slab)
        sizes = {
            "slab": lay.slab_bytes if own_slab else 0, "staging": lay.staging_bytes,
            "slots": R * B * K * 4, "misses": R * B * 4,
            "step_block": self.block_ints * 4, "topk_block": self.block_ints * 4,
            "plan_rows": B * K * 4, "plan_slots": B * K * 4,
            "stats": self.stats_bytes,
            "write_rows": (1 + lay.staging_rows) * 4, "drop_rows": (1 + lay.staging_rows) * 4,
            "layers": lay.num_layers * 4,
            "workspace": B * int(workspace_bytes),
            "done": R * 4,
        }
        L = lay.num_layers
        self.doorbell = bool(doorbell)
        if self.doorbell:
            sizes.update({"db_step": self.block_ints * 4, "db_topk": G * self.block_ints * 4,
                          "db_slots": G * B * K * 4, "db_misses": G * B * 4,
                          "db_ctl": (1 + G + L + 1) * 4, "db_layers": L * G * 2 * 4})
        self.prefetch = bool(prefetch)
        pf_width = 1 + max(len(g) for g in lay.groups)
        if self.prefetch:
            # pf_err: everything skv_prefetch refuses (a bad descriptor or state row), the
            # resolve of the same block refused and reported first; counted again in the
            # rank's record, it would fail a later request a second time.
            sizes.update({"pf_rows": B * K * 4, "pf_slots": B * K * 4, "pf_counts": B * 4,
                          "pf_layers": G * pf_width * 4, "pf_err": ERR_INTS * 4})
        self.offsets: dict[str, int] = {}
        try:
            for name, n in sizes.items():
                self.offsets[name] = arena.allocate(max(n, 1))
        except ArenaFull as e:
            self.release()
            raise ResidencyError("TOO_LARGE", str(e)) from None
        v, o = arena.view, self.offsets
        with cp.cuda.Device(arena.device):
            init = cp.cuda.Stream(non_blocking=True)
            init.__enter__()
            self.slab = v(o["slab"], lay.slab_shape) if own_slab else None
            self.staging = v(o["staging"], lay.staging_shape) if lay.staging_rows else None
            self.slots = v(o["slots"], (R, B, K), "int32")
            self.misses = v(o["misses"], (R, B), "int32")
            self.step = BlockView(v(o["step_block"], (self.block_ints,), "int32"), B)
            self.topk = BlockView(v(o["topk_block"], (self.block_ints,), "int32"), B)
            self.plan_rows = v(o["plan_rows"], (B, K), "int32")
            self.plan_slots = v(o["plan_slots"], (B, K), "int32")
            self.stats = v(o["stats"], (self.stats_bytes,))
            self.counters = v(o["stats"], (G, COUNTERS_PER_GROUP), "uint64")
            self.err = v(o["stats"] + G * COUNTERS_PER_GROUP * 8, (ERR_INTS,), "int32")
            self.write_rows = v(o["write_rows"], (1 + lay.staging_rows,), "int32")
            self.drop_rows = v(o["drop_rows"], (1 + lay.staging_rows,), "int32")
            self.layers = v(o["layers"], (lay.num_layers,), "int32")
            self.workspace = v(o["workspace"], (max(B * int(workspace_bytes), 1),)) if workspace_bytes else None
            self.done = v(o["done"], (R,), "uint32")
            self.done.fill(0)
            if self.doorbell:
                self.db_step = BlockView(v(o["db_step"], (self.block_ints,), "int32"), B)
                self.db_topk = [BlockView(v(o["db_topk"] + g * self.block_ints * 4, (self.block_ints,), "int32"), B)
                                for g in range(G)]
                self.db_slots = v(o["db_slots"], (G, B, K), "int32")
                self.db_misses = v(o["db_misses"], (G, B), "int32")
                self.db_ctl = v(o["db_ctl"], (1 + G + L + 1,), "uint32")
                self.db_layers = v(o["db_layers"], (L, G, 2), "int32")
                table = np.zeros((L, G, 2), np.int32)
                for g, layers in enumerate(lay.groups):
                    for layer in layers:
                        table[layer, g] = (1, layer)
                self.db_layers.set(table)
                self.db_step.block.fill(0)
                for blk in self.db_topk:
                    blk.block.fill(0)
                self.db_slots.fill(-1)
                self.db_misses.fill(0)
                self.db_ctl.fill(0)
            if self.prefetch:
                self.pf_rows = v(o["pf_rows"], (B, K), "int32")
                self.pf_slots = v(o["pf_slots"], (B, K), "int32")
                self.pf_counts = v(o["pf_counts"], (B,), "int32")
                self.pf_counts.fill(0)
                self.pf_layers = v(o["pf_layers"], (G, pf_width), "int32")
                self.pf_layers.set(prefetch_layers(lay))
                self.pf_err = v(o["pf_err"], (ERR_INTS,), "int32")
                self.pf_err.fill(0)
            # Known contents before the first request: empty results, zero counters.
            self.slots.fill(-1)
            self.misses.fill(0)
            self.stats.fill(0)
            self.step.block.fill(0)
            self.topk.block.fill(0)
            # Wait for these fills only: never the whole device (a doorbell rank's stream
            # waits on its engine's bells for as long as it lives).
            init.synchronize()
            init.__exit__(None, None, None)
        # Pinned host side: R step blocks, R top-k blocks, the stats mirror, the write blocks.
        n_write = 1 + lay.staging_rows
        total = 4 * R * (self.block_ints * 4 + 256) + self.stats_bytes + 256 + 2 * (n_write * 4 + 256) \
            + lay.num_layers * 4 + 256 + PF_COUNTERS * 8 + 256 + 256
        try:
            self.host = make_host(total, blocks_name)
        except BaseException:
            self.release()
            raise
        try:
            # Written by the daemon (requests whose arrays came on the socket) ...
            self.host_step = [self._host_block() for _ in range(R)]
            self.host_topk = [self._host_block() for _ in range(R)]
            # ... and by the client (it names the entry in a small TOPK message).
            self.client_step = [self._host_block() for _ in range(R)]
            self.client_topk = [self._host_block() for _ in range(R)]
            self.host_stats, self.host_stats_address = self.host.take(self.stats_bytes, np.uint8, (self.stats_bytes,))
            self.host_counters = self.host_stats[: G * COUNTERS_PER_GROUP * 8].view(np.uint64).reshape(G, -1)
            self.host_err = self.host_stats[G * COUNTERS_PER_GROUP * 8:].view(np.int32)
            self.host_write_rows, _ = self.host.take(n_write * 4, np.int32, (n_write,))
            self.host_drop_rows, _ = self.host.take(n_write * 4, np.int32, (n_write,))
            self.host_layers, _ = self.host.take(lay.num_layers * 4, np.int32, (lay.num_layers,))
            # The prefetch counters' mirror (stays 0 without prefetch).
            self.host_pf, self.host_pf_address = self.host.take(PF_COUNTERS * 8, np.uint64, (PF_COUNTERS,))
            self.host_pf[:] = 0
            # The host's copy of a doorbell rank's stop word (set with it by the daemon): the
            # handle's watcher reads it with a plain load, no CUDA call (which would break an
            # engine's graph capture under way in another thread).
            self.host_stop, _ = self.host.take(4, np.int32, (1,))
            self.host_stop[:] = 0
        except Exception:
            self.host.close()
            self.release()
            raise

    def _host_block(self) -> tuple[BlockView, int]:
        a, addr = self.host.take(self.block_ints * 4, np.int32, (self.block_ints,))
        a[:] = 0
        return BlockView(a, self.max_batch), addr

    def export(self, device: int, bus_id: str, events: list[bytes]) -> dict:
        """What the client needs to open this rank's memory (the ATTACH reply's handles)."""
        lay, o = self.layout, self.offsets
        out = {"kind": "cuda_ipc", "device": device, "bus_id": bus_id,
                "arena_handle": self.arena.handle, "arena_bytes": self.arena.nbytes,
                "slab_offset": o["slab"] if self.own_slab else None, "engine_slab": not self.own_slab,
                "staging_offset": o["staging"],
                "slots_offset": o["slots"], "misses_offset": o["misses"],
                "step_block_offset": o["step_block"], "topk_block_offset": o["topk_block"],
                "block_ints": self.block_ints,
                # The pinned host step blocks' descriptor on the fd socket (None: none to map).
                "blocks_fd": "blocks" if self.host.fd is not None else None, "blocks_bytes": self.host.nbytes,
                "client_step_offsets": [self.host.offset_of(b.block) for b, _ in self.client_step],
                "client_topk_offsets": [self.host.offset_of(b.block) for b, _ in self.client_topk],
                "ring_depth": self.ring_depth, "max_batch": self.max_batch, "top_k": lay.top_k,
                "events": events,
                "done_offset": o["done"],
                # The pinned mirror of the error record (a doorbell handle's check() reads it).
                "err_offset": self.host.offset_of(self.host_err)}
        if self.doorbell:
            g, L = lay.num_groups, lay.num_layers
            out["doorbell"] = {"step_block_offset": o["db_step"], "topk_block_offset": o["db_topk"],
                               "slots_offset": o["db_slots"], "misses_offset": o["db_misses"],
                               "ctl_offset": o["db_ctl"], "bell_step": 0, "bells": [1 + i for i in range(g)],
                               "ready": [1 + g + i for i in range(L)], "stopped": 1 + g + L,
                               "stopped_host_offset": self.host.offset_of(self.host_stop)}
        return out

    def release(self) -> None:
        """Give the arena ranges back (after the GPU is done with them)."""
        for off in self.offsets.values():
            self.arena.release(off)
        self.offsets = {}

    def close(self, free: FreeFn = free_now, spare=None) -> None:
        """Give the arena ranges back; the host blocks to ``spare`` (kept for reuse), else
        through ``free`` (``deferred.py``: unregistering them waits for every stream of the
        daemon)."""
        self.release()
        host, self.host = self.host, None
        if host is None:
            return
        if spare is not None:
            spare(host)
        else:
            free("pinned host blocks", host.nbytes, host.close)
