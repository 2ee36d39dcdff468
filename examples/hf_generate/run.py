"""Generate with a transformers DeepSeek-V3.2 or GLM-5 (DSA) model whose per-token rows
live in sparsekv, and check the tokens against transformers' own eager path.

    python examples/hf_generate/run.py                              # tiny random DeepSeek-V3.2, in process
    python examples/hf_generate/run.py --model glm_moe_dsa          # tiny random GLM-5 (index groups)
    python examples/hf_generate/run.py --run-dir /tmp/skv           # a running sparsekvd (cpu backend)
    python examples/hf_generate/run.py --device cuda:0 --run-dir /run/sparsekv   # a cuda daemon, doorbell
    python examples/hf_generate/run.py --model /path/to/checkpoint  # a local checkpoint (no downloads)

Prints the generated ids of both paths and whether they are equal (exit status 1 if not).
The model runs in float32 (a checkpoint is loaded so): the two paths sum the same terms in
another order, which in bf16 or fp16 can flip a token after a few steps.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

try:
    import torch
    from transformers import (AutoModelForCausalLM, DeepseekV32Config, DeepseekV32ForCausalLM, GlmMoeDsaConfig,
                              GlmMoeDsaForCausalLM)
except ImportError:  # one line, not a traceback
    sys.exit("examples/hf_generate needs torch and transformers: pip install 'sparsekv[transformers]'")

from sparsekv import hf
from sparsekv.client import Client, SparseKVError
from sparsekv.embedded.inproc import InprocClient

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
            index_topk=16, index_head_dim=32, index_n_heads=2, pad_token_id=0, eos_token_id=None,
            bos_token_id=None, initializer_range=0.2)


def load(name: str, device: str):
    if name == "deepseek_v32":
        model = DeepseekV32ForCausalLM(DeepseekV32Config(**TINY, num_hidden_layers=3, first_k_dense_replace=1))
    elif name == "glm_moe_dsa":
        cfg = GlmMoeDsaConfig(**TINY, num_hidden_layers=4, indexer_types=["full", "shared", "full", "shared"])
        model = GlmMoeDsaForCausalLM(cfg)
    else:  # a local checkpoint
        model = AutoModelForCausalLM.from_pretrained(name, local_files_only=True, dtype=torch.float32)
    return model.to(device).eval()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek_v32", help="deepseek_v32 or glm_moe_dsa (tiny, random), or a path")
    ap.add_argument("--run-dir", help="a running sparsekvd's run dir (default: sparsekv in this process, cpu only)")
    ap.add_argument("--device", default="cpu", help="where the model runs (cuda:N needs a cuda daemon: --run-dir)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--sample", action="store_true", help="sample (seeded) instead of greedy")
    a = ap.parse_args(argv)
    if a.new_tokens < 1:
        ap.error(f"--new-tokens must be >= 1, got {a.new_tokens}")
    if a.device != "cpu" and not a.run_dir:
        ap.error("a model on the GPU reads its rows from a cuda daemon's slab: pass --run-dir")
    torch.manual_seed(0)
    model = load(a.model, a.device)
    lengths = (24, 9, 17)  # three prompts, left-padded to one batch
    ids = torch.randint(1, model.config.vocab_size, (len(lengths), max(lengths)))
    mask = torch.ones_like(ids)
    for b, n in enumerate(lengths):
        ids[b, : max(lengths) - n], mask[b, : max(lengths) - n] = 0, 0
    ids, mask = ids.to(a.device), mask.to(a.device)
    kw = dict(attention_mask=mask, max_new_tokens=a.new_tokens, do_sample=a.sample)

    with contextlib.ExitStack() as stack:
        if a.run_dir:  # connected first: a daemon that is not there is said before the eager run
            on_gpu = a.device.startswith("cuda")
            client = stack.enter_context(Client(a.run_dir, name="hf-example", device=a.device))
            transport = "doorbell" if on_gpu else "zmq"
        else:
            client, transport = stack.enter_context(InprocClient()), "zmq"
        model.set_attn_implementation("eager")  # transformers' own path: a DynamicCache of per-head K/V
        torch.manual_seed(1)
        eager = model.generate(ids, **kw)
        # The pool holds each token's latent + rope row per layer; 3 sequences of at most
        # prompt + new tokens, in blocks of 16 rows.
        rows = len(lengths) * -(-(max(lengths) + a.new_tokens) // 16) * 16
        runtime = hf.enable(model, client, max_batch=len(lengths), host_rows=rows, block_size=16, transport=transport)
        torch.manual_seed(1)
        served = model.generate(ids, **kw)  # plain generate: the rows go to sparsekv, decode reads them back
        print(f"pool rows per layer: {rows} ({runtime.layout.row_bytes} bytes each); free again after generate: "
              f"{runtime.free_rows}")
        hf.disable(model)

    new = max(lengths)
    for b in range(len(lengths)):
        print(f"sequence {b}: eager    {eager[b, new:].tolist()}")
        print(f"sequence {b}: sparsekv {served[b, new:].tolist()}")
    same = torch.equal(eager, served)
    print(f"tokens {'equal' if same else 'NOT equal'}: transformers eager vs sparsekv, {a.new_tokens} new tokens")
    return 0 if same else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (SparseKVError, OSError) as e:  # no daemon, a checkpoint not found: one line (2: not a comparison)
        print(f"run.py: {e}", file=sys.stderr)
        sys.exit(2)
