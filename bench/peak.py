"""Run a command and say the GPU memory it took at its peak: nvidia-smi's used memory of the device,
read every 0.2 s while the command runs (what the process held, its CUDA context and allocator
cache included: what a user must have free), less what was used before it started.

    python3 bench/peak.py COMMAND [ARGS...]
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time


def used_mib() -> float:
    text = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "--id=0"],
        capture_output=True,
        text=True,
    ).stdout
    return float(text.strip().splitlines()[0]) if text.strip() else 0.0


def main() -> int:
    before = used_mib()
    peak = [before]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], used_mib())
            time.sleep(0.2)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    status = subprocess.call(sys.argv[1:])
    done.set()
    watcher.join()
    print(f"peak GPU memory {(peak[0] - before) / 1024:.1f} GiB (nvidia-smi, above the {before / 1024:.1f} GiB before)")
    return status


if __name__ == "__main__":
    sys.exit(main())
