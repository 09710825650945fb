"""The dependency versions spds is tested with, and one warning per package outside them.

spds leans on a few private or undocumented APIs, each the only way to do its job:
    torch         torch.ops.aten._flash_attention_forward / _scaled_dot_product_flash_attention
                  (packed records without a padded copy), cpp_extension._get_build_directory
                  (DeepSpeed's CPU comm op cache)
    deepspeed     the keys of save_checkpoint's model-states file (spds restores them itself,
                  without unpickling code)
    transformers  config._attn_implementation and the attention interface's calling convention
    liger-kernel  _apply_liger_kernel_to_instance and MODEL_TYPE_TO_APPLY_LIGER_FN
    flash-attn-4  flash_attn.cute's varlen entry points (a beta)
A release outside the range below may have moved one of them. The ranges are those of
requirements/cpu.txt (what CI tests) and requirements/gpu.txt (what bench/RESULTS.md measured);
tests/test_packaging.py keeps the three in agreement.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

TESTED = {
    "torch": SpecifierSet(">=2.11,<2.14"),
    "deepspeed": SpecifierSet(">=0.19.8,<0.20"),
    "transformers": SpecifierSet(">=5.17,<5.26"),
    "liger-kernel": SpecifierSet(">=0.8.5,<0.9"),
    "flash-attn-4": SpecifierSet("==4.0.0b36"),
}


def untested() -> list[str]:
    """One line per installed package whose version lies outside TESTED."""
    lines = []
    for package, tested in TESTED.items():
        try:
            installed = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue  # an optional one (liger-kernel, flash-attn-4) not installed: nothing of it runs
        try:
            version = Version(installed)
        except InvalidVersion:
            version = None
        # A local build tag (torch's +cpu, +cu130) is the same release.
        if version is None or not tested.contains(Version(version.public), prereleases=True):
            lines.append(
                f"spds: {package} {installed} is outside the versions spds is tested with ({tested}); "
                f"spds uses its private API (spds/contract/versions.py), so check a smoke run before trusting a "
                f"result, or install the tested set (requirements/)"
            )
    return lines


def warn_untested() -> None:
    """At start-up, on stderr, once per process (rank 0 only under a launcher)."""
    if os.environ.get("RANK", "0") != "0":
        return
    for line in untested():
        print(line, file=sys.stderr)
