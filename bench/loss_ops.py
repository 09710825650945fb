"""How many vocabulary-wide operations the distillation kernel launches per chunk of rows (CPU
profiler, top-level aten ops of spds.model.loss.distillation_rows). On a GPU each is a kernel launch per
chunk, and the KL step's loss was found launch-bound (bench/RESULTS.md); fewer is faster there.

    python bench/loss_ops.py
"""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from spds.model.loss import Divergence, distillation_rows


def main() -> None:
    torch.manual_seed(0)
    logits, teacher = torch.randn(64, 1000), torch.randn(64, 1000)
    targets = torch.randint(0, 1000, (64,))
    cases = {
        "kl (forward, T 1)": Divergence(0.0, 1.0),
        "kl (forward, T 2)": Divergence(0.0, 1.0, temperature=2.0),
        "mix (ce 0.5 + kl 0.5)": Divergence(0.5, 0.5),
        "kl (reverse)": Divergence(0.0, 1.0, direction="reverse"),
    }
    for name, spec in cases.items():
        with profile(activities=[ProfilerActivity.CPU]) as trace:
            distillation_rows(logits, targets, teacher, None, None, spec)
        ops = [e for e in trace.events() if e.name.startswith("aten::") and e.cpu_parent is None]
        print(f"{name}: {len(ops)} top-level aten ops per chunk")


if __name__ == "__main__":
    main()
