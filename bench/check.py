"""The CUDA-only paths against a reference (flash's varlen and LSE calls, CUDA graphs, FA4, FP8,
windowed attention, Liger): one tool, a named case each (bench/checks/check_CASE.py holds it).

    python bench/check.py CASE [options]      python bench/check.py CASE --help
(each prints what it compared and how far apart; the figures are in bench/RESULTS.md)
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
CASES = {path.stem.removeprefix("check_"): path for path in sorted((BENCH / "checks").glob("check_*.py"))}


def main() -> int:
    first = {
        name: (ast.get_docstring(ast.parse(path.read_text())) or "\n").splitlines()[0] for name, path in CASES.items()
    }
    epilog = "cases:\n" + "\n".join(f"  {name:18s} {line}" for name, line in first.items())
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=epilog
    )
    parser.add_argument("case", choices=sorted(CASES))
    chosen, rest = parser.parse_args(sys.argv[1:2]), sys.argv[2:]  # the case's --help is the case's
    # the case's own imports: spds (the repository), bench's tools, the other cases, the tests' references
    sys.path[:0] = [str(BENCH.parent), str(BENCH), str(BENCH / "checks"), str(BENCH.parent / "tests")]
    case = importlib.import_module(CASES[chosen.case].stem)
    own = argparse.ArgumentParser(
        prog=f"bench/check.py {chosen.case}",
        description=case.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if hasattr(case, "options"):
        case.options(own)
    return case.main(own.parse_args(rest)) or 0


if __name__ == "__main__":
    sys.exit(main())
