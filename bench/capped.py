"""Run one spds command with a per-GPU memory cap, as if each GPU had only GIB of memory.

    torchrun --nproc_per_node 2 bench/capped.py 26 train config.json

For showing, on large GPUs, what happens to a student larger than one GPU (bench/gpu_x2_sharded.sh).
"""

import os
import sys

import torch

from spds.cli import main

gib, args = float(sys.argv[1]), sys.argv[2:]
device = int(os.environ.get("LOCAL_RANK", 0))
if torch.cuda.is_available():  # without a GPU (a dry run of the script), no cap
    torch.cuda.set_per_process_memory_fraction(
        gib * 2**30 / torch.cuda.get_device_properties(device).total_memory, device
    )
sys.exit(main(args))
