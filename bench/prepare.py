"""Prepare throughput and memory on synthetic candidate files (CPU only).

    python bench/prepare.py [--tokens 10000000] [--lengths 2000 200]

For each mean record length, writes a synthetic token-form candidate file of about --tokens
tokens (tiny example tokenizer), runs `spds prepare` in a fresh process and reports
records/s, tokens/s and the process's peak RSS. Flat RSS across record counts shows that
prepare streams.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples" / "tiny"))
import make_tiny  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
import common  # noqa: E402


def write_candidates(path: Path, tokenizer, total_tokens: int, mean_length: int, seed: int = 0) -> tuple[int, int]:
    rng = random.Random(seed)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Summarise the archive."}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    eos = tokenizer.eos_token_id
    rows = tokens = 0
    with open(path, "w") as stream:
        while tokens < total_tokens:
            n = max(2, int(rng.expovariate(1 / mean_length)))
            response = [rng.randrange(32, 127) for _ in range(n)] + [eos]
            ids = list(prompt) + response
            stream.write(
                json.dumps(
                    dict(
                        request_id=f"r{rows}",
                        question_id=f"q{rows // 4}",
                        sample_index=rows % 4,
                        input_ids=ids,
                        prefix_tokens=len(prompt),
                        labels=[-100] * len(prompt) + response,
                        supervised_tokens=len(response),
                        response_sha256=hashlib.sha256(bytes(response[:-1])).hexdigest(),
                    )
                )
                + "\n"
            )
            rows += 1
            tokens += len(ids)
    return rows, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=10_000_000, help="tokens per candidate file (default 1e7)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 200], help="mean record lengths")
    args = parser.parse_args()
    for mean_length in args.lengths:
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(scratch)
            tokenizer = make_tiny.chatml_tokenizer()
            make_tiny.save_student(directory / "student", tokenizer, layers=1, hidden=32)
            rows, tokens = write_candidates(directory / "candidates.jsonl", tokenizer, args.tokens, mean_length)
            make_tiny.tiny_config(
                directory,
                data={"candidates": [{"path": "candidates.jsonl"}], "packed_dir": "packed", "context_limit": 1 << 20},
            )
            started = time.monotonic()
            # A fresh process per run, reporting its own peak RSS (RUSAGE_CHILDREN would keep the
            # largest child so far).
            probe = (
                "import resource, sys; from spds.cli import main; code = main(['prepare', sys.argv[1]]); "
                "print('PEAK_RSS_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
            )
            output = subprocess.run(
                [sys.executable, "-c", probe, str(directory / "config.json")],
                check=True,
                capture_output=True,
                text=True,
                cwd=REPO,
            ).stdout
            seconds = time.monotonic() - started
            peak = int(output.split("PEAK_RSS_KIB")[1].split()[0]) / 1024
            size = (directory / "candidates.jsonl").stat().st_size / 2**20
            common.record(
                figure="spds prepare",
                mean_length=mean_length,
                records=rows,
                tokens=tokens,
                seconds=round(seconds, 1),
                tokens_per_second=round(tokens / seconds),
                peak_rss_mib=round(peak),
                file_mib=round(size),
            )


if __name__ == "__main__":
    main()
