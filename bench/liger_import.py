"""What importing Liger adds to spds's start-up, after what spds imports anyway (torch,
transformers with a model's modules, deepspeed), in a fresh process.

    python bench/liger_import.py plain

`hidden` (measured once, bench/results/LOG.md) hid peft from Liger's first import: Liger probes for it
only to recognise PEFT's wrapper modules. It saved 0.3 s, too little for the trick, and spds does
not do it; the mode is kept so that the figure can be measured again.
"""

from __future__ import annotations

import sys
import time

started = time.perf_counter()
import deepspeed  # noqa: E402, F401
import torch  # noqa: E402, F401
import transformers.models.qwen3.modeling_qwen3  # noqa: E402, F401
from transformers import AutoModelForCausalLM  # noqa: E402, F401

before = time.perf_counter()
if sys.argv[1] == "hidden":
    sys.modules["peft"] = None  # `import peft` fails while Liger is imported
    import liger_kernel.transformers  # noqa: F401

    del sys.modules["peft"]
else:
    import liger_kernel.transformers  # noqa: F401
done = time.perf_counter()
print(
    f"{sys.argv[1]}: torch, transformers, deepspeed {before - started:.2f} s; then Liger {done - before:.2f} s "
    f"(peft imported: {'peft' in sys.modules and sys.modules['peft'] is not None})",
    flush=True,
)
