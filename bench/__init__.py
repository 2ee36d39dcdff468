"""``sparsekv bench`` and the tools that drive the whole stack with a trace: speed figures as
ratios against a baseline measured in the same run, replays checked byte for byte."""
