"""Block store soak (marked ``soak``: ``make soak`` runs it), cpu backend, real processes:
two engines of one uid serve requests whose prompts share a system prompt, over a store
too small for all of them (eviction pressure), while engines are SIGKILLed, some holding
pins in the middle of a request, and started again. Every position of every request is
read back through its block table and checked byte for byte (``bad``), its indexer keys
read from the blocks' keys plane too (``bad_keys``), and the daemon's
counters must show hits, evictions, admissions refused by POOL_EXHAUSTED, and chains an
engine looked up again named by token (DESIGN §9)."""

import json
import random
import time

import pytest

import helpers
from sparsekv.proto import settings
from block_engine import BS, INDEX_BYTES, Engine, tokens

pytestmark = pytest.mark.soak
SOAK_S = settings.SOAK_S.get()


def test_two_engines_kills_restarts_and_eviction_leave_every_byte_right():
    rng = random.Random(36)
    system = tokens(0, 6)  # 6 shared blocks
    prompts = [system + tokens(100 + i, rng.randint(1, 5)) for i in range(12)]  # > 16 blocks in all
    totals = {"requests": 0, "refused": 0, "hit_blocks": 0, "bad": 0, "bad_keys": 0, "kills": 0, "duplicates": 0}
    with helpers.serving_daemon(4 << 20) as d:
        engines = [Engine(d.run_dir, index_bytes=INDEX_BYTES), Engine(d.run_dir, index_bytes=INDEX_BYTES)]
        held = [False, False]  # an engine that kept its last request's pins
        try:
            t_end = time.monotonic() + SOAK_S
            while time.monotonic() < t_end:
                i = rng.randrange(2)
                if rng.random() < 0.05:  # killed, pins and all, then started again
                    engines[i].kill()
                    engines[i], held[i] = Engine(d.run_dir, index_bytes=INDEX_BYTES), False
                    totals["kills"] += 1
                    continue
                prompt = rng.choice(prompts)
                keep = not held[i] and rng.random() < 0.3  # pinned until this engine is killed
                got = engines[i]("request", tokens=prompt, release=not keep)
                totals["requests"] += 1
                if "refused" in got:
                    totals["refused"] += 1
                    totals["hit_blocks"] += got["hit"]  # looked up before the refusal
                    f = got["refused"]
                    assert f["free"] + f["evictable"] - f["reserved"] < len(prompt) // BS
                    continue
                assert "err" not in got, got
                held[i] |= keep
                totals["hit_blocks"] += got["hit"]
                totals["bad"] += got["bad"]
                totals["bad_keys"] += got["bad_keys"]
                totals["duplicates"] += got["duplicates"]
        finally:
            for e in engines:
                e.close()
        stats = helpers.stats_json(d.run_dir)
    print(json.dumps({**totals, "evictions": stats["block_evictions"], "chain_lookups": stats["block_chain_lookups"],
                      "chain_resends": stats["block_chain_resends"], "soak_s": SOAK_S}))
    assert totals["bad"] == totals["bad_keys"] == 0
    assert totals["kills"] and totals["hit_blocks"] and stats["block_evictions"]
    assert stats["block_chain_lookups"]  # prompts looked up again by the same engine: named by token
    assert stats["block_hit_tokens"] == totals["hit_blocks"] * BS
