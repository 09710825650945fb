"""spds command line: parse arguments, call one function, map errors to exit codes.

Exit codes: 0 success; 1 a refusal the user can act on (bad config, changed input, bad row,
failed check), printed without a traceback; 2 bad command-line usage (argparse).

Each verb imports its own modules when it runs ("per verb" below): `spds validate` or `spds stop`
does not wait seconds for torch and transformers to load.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from spds.contract.versions import warn_untested
from spds.errors import SpdsError

STARTED = time.time()  # `spds train` to update 1 is measured from here (run.json startup_seconds)


def cmd_validate(args) -> int:
    from spds.contract.gate import load_config  # per verb
    from spds.generation.teacher_window import require_ready  # per verb

    failures = 0
    for path in args.configs:
        try:
            config = load_config(path, candidates="generate writes one")  # validate runs before generate
            require_ready(config)  # what prepare and the teacher's window refuse, before any generation or packing
            print(
                f"ok  {config.path} (deepspeed config {config.deepspeed_config_path})",
                file=sys.stderr if args.print_output_dir else sys.stdout,
            )
            if config.context.documents:  # what the corpus holds, and what it skipped and why
                print(corpus_listing(config), file=sys.stderr if args.print_output_dir else sys.stdout)
            if args.print_output_dir:  # the launch scripts fix at launch where their stop requests go
                print(config.output_dir)
        except SpdsError as error:
            failures += 1
            print(f"FAIL {error}", file=sys.stderr)
    return 1 if failures else 0


def corpus_listing(config, most: int = 20) -> str:
    from spds.contract.documents import listing, shown  # per verb

    held = listing(config)
    lines = [f"    corpus: {len(held.found)} files read, {len(held.skipped)} skipped"]
    lines += [f"    skipped {shown(path)}: {why}" for path, why in held.skipped[:most]]
    if len(held.skipped) > most:
        lines.append(f"    ... and {len(held.skipped) - most} more skipped")
    return "\n".join(lines)


def cmd_pin(args) -> int:
    from pathlib import Path

    from spds.contract.gate import pin_config  # per verb
    from spds.contract.pins import pins_path  # per verb

    for key, digest in pin_config(args.config).items():
        print(f"{key} = {digest}")
    print(f"pinned in {pins_path(Path(args.config).resolve())} (every command checks it; the config is unchanged)")
    return 0


def cmd_prepare(args) -> int:
    from spds.contract.gate import load_config  # per verb
    from spds.data.preflight import require_preflight  # per verb
    from spds.data.prepare import prepare  # per verb

    config = load_config(args.config)
    require_preflight(config)  # the windows and the template, before a row is read
    manifest = prepare(config)
    print(json.dumps({k: manifest[k] for k in ("records", "tokens", "max_length", "counts")}))
    return 0


def cmd_train(args) -> int:
    from spds.training.train import main as train_main  # per verb

    return train_main(args.config, smoke=args.verb == "smoke", started=STARTED)


def cmd_stop(args) -> int:
    from pathlib import Path

    from spds.contract.gate import load_config  # per verb
    from spds.stop import request  # per verb

    if args.output_dir:  # where the launch scripts found it at launch: the config may have moved since
        output_dir = Path(args.output_dir)
    elif args.config:
        output_dir = load_config(args.config, check_pins=False, candidates="unread").output_dir
    else:
        raise SpdsError("name the run's CONFIG (or --output-dir)")
    path = request(output_dir, args.why)
    print(
        f"spds stop: requested in {path}; a train stops after the update in flight (with a checkpoint), a "
        "generate or eval after the batch in flight (its batches kept whole)"
    )
    return 0


def cmd_generate(args) -> int:
    from spds.contract.gate import load_config  # per verb
    from spds.generation.generate import generate  # per verb

    generate(load_config(args.config, candidates="unread"), started=STARTED, adopt=args.adopt)
    return 0  # also when stopped: its batches are whole and the same command completes them (it said so)


def cmd_eval(args) -> int:
    import os

    from spds.contract.gate import load_config  # per verb
    from spds.generation.teacher_window import require_ready  # per verb
    from spds.trained.evaluate import evaluate  # per verb

    config = load_config(args.config)
    require_ready(config)  # the windows: eval.questions' teacher and the views read the context
    result = evaluate(config, args.checkpoint)
    if os.environ.get("RANK", "0") != "0":  # rank 0 reports for every rank
        return 0
    if result["records"]:
        print(
            f"held-out records {result['records']} ({result['supervised_tokens']} response tokens), "
            f"update {result['update']}"
        )
        print(nll_line(result))
    if result["kl_to_teacher"] is not None:
        print(f"KL(teacher || soft) per token {result['kl_to_teacher']:.4f} (teacher: {result['teacher']})")
    if result.get("samples"):
        from spds.trained.sample import show  # per verb

        print(show(result["samples"]))
    if result.get("questions"):
        from spds.trained.sample import show  # per verb

        asked = result["questions"]
        print(
            f"eval.questions: {asked['questions']} questions training never asked, {asked['records']} teacher "
            f"answers ({asked['supervised_tokens']} response tokens), update {result['update']}"
        )
        print(nll_line(asked))
        if "keyword_share" in asked:
            share = asked["keyword_share"]
            named = {"context": "truncated"} if result.get("corpus", {}).get("context") == "truncated" else {}
            print(
                "greedy answers holding the keyword  "
                + "  ".join(f"{named.get(view, view)} {share[view]:.0%}" for view in share)
            )
        if "rouge_l_soft_vs_context" in asked:
            print(f"ROUGE-L F1 of soft against context answers {asked['rouge_l_soft_vs_context']:.3f}")
        if asked.get("answers"):
            print(show(asked["answers"]))
    if result.get("tokens_per_second"):
        print(
            f"{result['tokens_per_second']:,.0f} positions/s over {result['world_size']} rank(s), "
            f"{result['seconds']:.1f} s"
        )
    print(f"eval.json and plot in {load_config(args.config).output_dir}")
    return 0


def nll_line(figures: dict) -> str:
    nll = figures["nll"]
    ceiling = "n/a" if nll["ceiling"] is None else f"{nll['ceiling']:.4f}"
    gap = "n/a" if figures["gap_recovered"] is None else f"{figures['gap_recovered']:.1%}"
    return f"NLL per token  floor {nll['floor']:.4f}  soft {nll['soft']:.4f}  ceiling {ceiling}  gap recovered {gap}"


def cmd_sample(args) -> int:
    from pathlib import Path

    from spds.contract.gate import load_config  # per verb
    from spds.trained.sample import answers, show, write  # per verb

    config = load_config(args.config)
    rows = answers(
        config, args.n, Path(args.questions) if args.questions else None, args.checkpoint, config.eval.max_new_tokens
    )
    print(show(rows))
    jsonl, markdown = write(config.output_dir, rows)
    print(f"{len(rows)} answers in {jsonl} and {markdown}")
    return 0


def cmd_export(args) -> int:
    from pathlib import Path

    from spds.contract.gate import load_config  # per verb
    from spds.trained.export import export  # per verb

    if args.compose:
        from spds.trained.export import compose  # per verb

        if args.config or args.checkpoint or args.out or len(args.compose) < 3:
            raise SpdsError("spds export --compose A.safetensors B.safetensors [...] OUT: two prompts or more, then "
                            "the output directory, and no config")  # fmt: skip
        print(json.dumps(compose([Path(p) for p in args.compose[:-1]], Path(args.compose[-1]), args.force)))
        return 0
    if not args.config:
        raise SpdsError("spds export CONFIG (or --compose A.safetensors B.safetensors OUT)")
    config = load_config(args.config)
    result = export(config, args.checkpoint, Path(args.out) if args.out else config.output_dir / "export")
    print(json.dumps(result))
    return 0


def cmd_init(args) -> int:
    from pathlib import Path

    from spds.starter import default_recipe, init  # per verb

    if args.recipe and not args.context:
        raise SpdsError("--recipe chooses the self-study recipe: it needs --context (the context to distill)")
    recipe = args.recipe or default_recipe()
    written = init(args.model, args.data, Path(args.out), args.context, recipe)
    first = f"spds generate {written.name} (self-study, the {recipe.upper()} recipe), " if args.context else ""
    print(f"wrote {written} (validated); next: {first}spds pin {written.name}, spds prepare, spds smoke, spds train")
    return 0


def cmd_launch_ended(args) -> int:
    import os
    from pathlib import Path

    from spds.training.records import record_launch_end  # per verb

    output_dir = Path(args.output_dir)  # as the launch script found it at launch
    out = output_dir / "smoke" if args.run_verb == "smoke" else output_dir
    started = float(os.environ.get("SPDS_LAUNCH_STARTED") or 0)
    path = record_launch_end(out, args.exit_status, started)
    if path:
        print(
            f"spds: the launch failed (exit status {args.exit_status}) and no rank recorded it: {path} says so",
            file=sys.stderr,
        )
    return 0


PROMPT_HELP = (
    "a committed checkpoint directory (default: the newest), or an exported soft_prompt.safetensors (a composed "
    "one too) whose placement and length the run's packed records were made for"
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spds", description="Soft-prompt distillation on a frozen causal LM.")
    # The deepspeed launcher puts --local_rank=N before the verb; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("init", help="write a commented starter config for MODEL and DATA, validated")
    p.add_argument("model", help="the student: a directory, or a hub id in the local Hugging Face cache")
    p.add_argument("data", help="a candidate rows file (jsonl); with --context, the one spds generate writes")
    p.add_argument(
        "--context",
        help="a context file to distill from alone, or a corpus (a directory of files, a JSONL of documents): "
        "the config has spds generate write DATA by self-study, with the measured recipe (docs/config.md)",
    )
    p.add_argument(
        "--recipe",
        choices=("cpu", "gpu"),
        default=None,
        help="with --context: the self-study recipe measured for training on a CPU (256 conversations, 64 "
        "updates of 8) or a GPU (1,280 conversations, 128 updates of 128); default: gpu where a CUDA device "
        "is visible, else cpu",
    )
    p.add_argument("--out", default="run.yaml", help="the config to write (default run.yaml; never overwritten)")
    p.set_defaults(run=cmd_init)
    p = verbs.add_parser("validate", help="validate configs, their DeepSpeed config and pinned inputs")
    p.add_argument("configs", nargs="+")
    p.add_argument("--print-output-dir", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_validate)
    for verb, text, run in [
        ("pin", "write the sha256 of every input to CONFIG.pins.json", cmd_pin),
        ("prepare", "check candidate rows and write the packed store", cmd_prepare),
        ("smoke", "one real update on the longest record, save, restore, verify", cmd_train),
        ("train", "train the soft prompt (resumes from the newest committed checkpoint)", cmd_train),
        ("generate", "the teacher answers the questions with the context: candidate rows", cmd_generate),
    ]:
        p = verbs.add_parser(verb, help=text)
        p.add_argument("config")
        p.set_defaults(run=run)
        if verb == "generate":
            p.add_argument(
                "--adopt",
                action="store_true",
                help="take the rows of a generate.output spds has no record of as written under these settings",
            )
    p = verbs.add_parser("stop", help="ask a running train or smoke to stop at the next update boundary")
    p.add_argument("config", nargs="?")
    p.add_argument("--output-dir", default=None, help="the run's output directory (instead of CONFIG)")
    p.add_argument("--why", default="spds stop", help=argparse.SUPPRESS)
    p.set_defaults(run=cmd_stop)
    p = verbs.add_parser(
        "launch-ended",
        help="(the launch scripts) record a launch that failed with no word from rank 0 in terminal.json",
    )
    p.add_argument("--output-dir", required=True)
    p.add_argument("--exit-status", type=int, required=True)
    p.add_argument("--verb", dest="run_verb", choices=("train", "smoke"), default="train")
    p.set_defaults(run=cmd_launch_ended)
    p = verbs.add_parser("eval", help="held-out NLL: floor, ceiling, soft prompt; gap recovered")
    p.add_argument("config")
    p.add_argument("--checkpoint", default=None, help=PROMPT_HELP)
    p.set_defaults(run=cmd_eval)
    p = verbs.add_parser("sample", help="answers by the bare student, with the context, and with the soft prompt")
    p.add_argument("config")
    p.add_argument(
        "--n", type=int, default=5, choices=range(1, 1001), metavar="N", help="how many questions (1-1000, default 5)"
    )
    p.add_argument(
        "--questions",
        default=None,
        help="a questions file (jsonl, as generate.questions); default: the held-out records",
    )
    p.add_argument("--checkpoint", default=None, help=PROMPT_HELP)
    p.set_defaults(run=cmd_sample)
    p = verbs.add_parser("export", help="safetensors soft prompt (and a PEFT adapter for prefix placement)")
    p.add_argument("config", nargs="?")
    p.add_argument(
        "--compose",
        nargs="+",
        metavar="PATH",
        help="A.safetensors B.safetensors [...] OUT: one prompt from exported ones of the same student, in order",
    )
    p.add_argument("--force", action="store_true", help="with --compose: replace a composed prompt already in OUT")
    p.add_argument("--checkpoint", default=None, help="a committed checkpoint directory (default: the newest)")
    p.add_argument("--out", default=None, help="output directory (default: OUTPUT_DIR/export)")
    p.set_defaults(run=cmd_export)
    return parser


def load_launch_environment() -> None:
    """Variables a launch script passed to this node's ranks in a file readable by its user only
    (launch/common.sh, whose SPDS_ENV_PREFIXES chooses them), not on a command line that a remote
    shell would interpret. Only this user can have written the file, so every name in it is set."""
    import os
    import stat

    path = os.environ.get("SPDS_ENV_FILE")
    if not path:
        return
    try:
        info = os.stat(path)
        data = open(path, "rb").read()
    except OSError as error:
        raise SpdsError(f"SPDS_ENV_FILE {path}: {error.strerror}") from None
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SpdsError(f"SPDS_ENV_FILE {path}: refused: it must belong to this user and be writable by no one else")
    for entry in data.split(b"\0"):
        key, _, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if key.isidentifier():
            os.environ[key] = value


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.verb in ("train", "smoke", "generate"):
        # Before torch is imported (seconds): from here on SIGTERM/SIGINT ask for a stop at an
        # update boundary (generate: a batch boundary) instead of killing the process (spds/stop.py).
        from spds.stop import StopRequest  # per verb

        StopRequest.install()
    try:
        load_launch_environment()  # before torch, NCCL or transformers read any of it
        warn_untested()
        return args.run(args)
    except SpdsError as error:
        print(f"spds {args.verb}: {error}", file=sys.stderr)
        return 1
    except OSError as error:  # what no spds layer turned into a message: still no traceback
        where = f" {error.filename}" if error.filename else ""
        print(f"spds {args.verb}:{where} {error.strerror or error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"spds {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
