"""spds's verbs end to end at a production shape, each one's wall seconds and peak GPU memory: by
default `spds generate` alone (generation end to end), or the whole pipeline with --verbs.

    python bench/pipeline.py --model 8b --context 32600 --conversations 1280        (self-study)
    python bench/pipeline.py --model 1.7b --context 4096 --questions 256 --samples 4 --batch 1024
    python bench/pipeline.py --model 8b --context 32600 --verbs generate,prepare,smoke,train,eval

A random-weight Qwen3-shaped student and teacher (bench/common.py), the byte-level tokenizer (a
character is a token), and a fact-sheet-like context of CONTEXT tokens (numbered lines of ~80).
Self-study (the default kinds, every kind) unless --questions is given; the GPU recipe for train
(mix to the top-20, 128-row updates, lr 0.1, bf16, Liger); eval asks --eval-questions questions
training never asked. Each verb runs as a user runs it (`python -m spds.cli VERB config.json`), its
log under --out; prints one JSON line per verb (bench/common.py's record) and one for generation's
rows per second, and after eval one for eval's scoring against the training step (positions/s, the
same student and rows). Random weights rarely sample the end token: every answer runs to max_new_tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SUBJECTS = ["harbor", "orchard", "glacier", "library", "meadow", "comet", "violin", "lantern", "river", "mountain"]


def write_inputs(directory: Path, args) -> None:
    import torch

    gpu = torch.cuda.is_available()  # Liger's kernels are CUDA's; a CPU dry run of the tool goes without
    lines, i = [], 0
    while sum(map(len, lines)) < args.context:
        lines.append(f"{i}. The {SUBJECTS[i % 10]} of wing {i} keeps ledger {7 * i} in drawer {i % 97}.\n")
        i += 1
    (directory / "context.md").write_text("".join(lines)[: args.context])
    with open(directory / "eval-questions.jsonl", "w") as stream:
        for q in range(args.eval_questions):
            line = dict(question_id=f"e{q}", question=f"Which drawer holds ledger {7 * q}?", keyword=str(q % 97))
            stream.write(json.dumps(line) + "\n")
    generate = dict(output="rows.jsonl", max_new_tokens=args.max_new, batch_size=args.batch, top_k_logprobs=20)
    if args.questions:
        with open(directory / "questions.jsonl", "w") as stream:
            for q in range(args.questions):
                stream.write(json.dumps(dict(question_id=f"q{q}", question=f"What does line {q} say?")) + "\n")
        generate.update(questions="questions.jsonl", samples_per_question=args.samples, temperature=1.0)
    else:
        generate["self_study"] = {"conversations": args.conversations, "chunk_tokens": 512}
    common.synthetic_run(
        directory,
        args.model,
        student={"model_path": "student", "dtype": "bfloat16", "liger_kernels": gpu},
        context={"file": "context.md"},
        soft_prompt={"length": 128, "placement": "system", "init": {"method": "context"}},
        generate=generate,
        data={
            "candidates": [{"path": "rows.jsonl"}],
            "packed_dir": "packed",
            "eval_fraction": 0.1,
            "context_limit": None,
        },
        loss={"objective": "mix", "teacher": "top_k"},
        optim={
            "updates": args.updates,
            "effective_batch": 128,
            "micro_batch": 32,
            "learning_rate": 0.1,
            "warmup_updates": 1,
            "schedule": "cosine",
            "seed": 0,
        },
        checkpoint={"every": 1000, "keep_last": 1},
        train={"require_smoke": "smoke" in args.verbs},
        eval={
            "questions": "eval-questions.jsonl",
            "max_new_tokens": 32,
            "samples": 0,
            "max_records": args.held_out or None,
            "question_samples": args.question_samples,
        },
    )


class PeakMemory:
    """nvidia-smi's used memory of the device, sampled while a command runs (the process's own
    allocator cannot be read from outside it)."""

    def __enter__(self):
        self.peak, self.running = 0, True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        import subprocess

        while self.running:
            query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]
            try:
                self.peak = max(self.peak, int(subprocess.run(query, capture_output=True, text=True).stdout.split()[0]))
            except (OSError, ValueError, IndexError):
                return
            time.sleep(0.2)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="1.7b", choices=sorted(common.SHAPES), help="a Qwen3 shape")
    parser.add_argument("--context", type=int, default=4096, help="context tokens (default 4096)")
    parser.add_argument("--conversations", type=int, default=256, help="self-study conversations (default 256)")
    parser.add_argument("--questions", type=int, default=0, help="questions instead of self-study")
    parser.add_argument("--samples", type=int, default=1, help="samples per question (with --questions)")
    parser.add_argument("--batch", type=int, default=256, help="generate.batch_size (default 256)")
    parser.add_argument("--max-new", type=int, default=256, help="generate.max_new_tokens (default 256)")
    parser.add_argument("--updates", type=int, default=8, help="training updates of 128 rows (default 8)")
    parser.add_argument("--eval-questions", type=int, default=200, help="eval questions (default 200)")
    parser.add_argument("--held-out", type=int, default=16, help="eval.max_records (0: every held-out record)")
    parser.add_argument("--question-samples", type=int, default=1, help="eval.question_samples")
    parser.add_argument("--verbs", default="generate", help="comma list of generate,prepare,smoke,train,eval")
    parser.add_argument("--out", help="raw output directory (default: outside the checkout, bench/common.py)")
    args = parser.parse_args()
    args.verbs = args.verbs.split(",")
    directory = common.out_dir(args.out, "pipeline") / f"{args.model}-{args.context}"
    directory.mkdir(parents=True, exist_ok=True)
    write_inputs(directory, args)
    for made in ("rows.jsonl", "rows.jsonl.provenance.json"):  # each run generates afresh
        (directory / made).unlink(missing_ok=True)
    if "train" in args.verbs:  # and trains afresh (a checkpoint of other settings is not resumed)
        shutil.rmtree(directory / "run", ignore_errors=True)
    for verb in args.verbs:
        with PeakMemory() as memory:
            command = [sys.executable, "-m", "spds.cli", verb, str(directory / "config.json")]
            status, seconds = common.timed(command, directory / f"{verb}.log", cwd=common.REPO)
        figure = dict(figure=f"spds {verb}", model=args.model, context=args.context, exit=status, seconds=seconds)
        common.record(**figure, peak_gpu_mib=memory.peak, log=str(directory / f"{verb}.log"))
        if verb == "generate" and status == 0:
            rows = [json.loads(line) for line in open(directory / "rows.jsonl")]
            new = sum(row["supervised_tokens"] for row in rows)
            common.record(
                figure="generate rate",
                model=args.model,
                context=args.context,
                rows=len(rows),
                rows_per_second=round(len(rows) / seconds, 2),
                new_tokens_per_second=round(new / seconds),
            )
        if verb == "eval" and status == 0 and (directory / "run" / "metrics.jsonl").exists():
            common.eval_against_step(directory / "run", model=args.model, context=args.context)
        if status != 0:
            print((directory / f"{verb}.log").read_text()[-3000:], file=sys.stderr)
            sys.exit(status)


if __name__ == "__main__":
    main()
