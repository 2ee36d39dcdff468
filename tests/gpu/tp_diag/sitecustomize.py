import os
if os.environ.get("DIAG_NOSTRIPE") == "1":
    try:
        from sparsekv.daemon.cuda import tp_doorbell
        tp_doorbell.TpDoorbellGroup._stripe_targets = lambda self: None
    except Exception as e:  # noqa
        print("diag patch failed", e)
if os.environ.get("DIAG_CARVEOUT"):
    try:
        import torch
        torch._C._set_sm_carveout_experimental(int(os.environ["DIAG_CARVEOUT"]))
        print("carveout", torch._C._get_sm_carveout_experimental(), flush=True)
    except Exception as e:  # noqa
        print("carveout failed", e)
