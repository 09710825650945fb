"""spds command line: parse arguments, call one function, map errors to exit codes.

Exit codes: 0 success; 1 a refusal the user can act on (bad config, changed input, bad row,
failed check), printed without a traceback; 2 bad command-line usage (argparse).
"""
from __future__ import annotations

import argparse
import json
import sys

from .fsio import SpdsError


def cmd_validate(args) -> int:
    from .contract import load_config

    failures = 0
    for path in args.configs:
        try:
            config = load_config(path)
            print(f"ok  {config.path} (deepspeed config {config.deepspeed_config_path})")
        except SpdsError as error:
            failures += 1
            print(f"FAIL {error}", file=sys.stderr)
    return 1 if failures else 0


def cmd_pin(args) -> int:
    from .contract import pin_config

    for key, digest in pin_config(args.config).items():
        print(f"{key} = {digest}")
    return 0


def cmd_prepare(args) -> int:
    from .contract import load_config
    from .data.prepare import prepare

    manifest = prepare(load_config(args.config))
    print(json.dumps({k: manifest[k] for k in ("records", "tokens", "max_length", "counts")}))
    return 0


def cmd_train(args) -> int:
    from .train import main as train_main

    return train_main(args.config, smoke=args.verb == "smoke")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spds", description="Soft-prompt distillation on a frozen causal LM.")
    # The deepspeed launcher puts --local_rank=N before the verb; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("validate", help="validate configs, their DeepSpeed config and pinned inputs")
    p.add_argument("configs", nargs="+")
    p.set_defaults(run=cmd_validate)
    p = verbs.add_parser("pin", help="write the sha256 of every input into the config")
    p.add_argument("config")
    p.set_defaults(run=cmd_pin)
    p = verbs.add_parser("prepare", help="check candidate rows and write the packed store")
    p.add_argument("config")
    p.set_defaults(run=cmd_prepare)
    for verb, text in [("smoke", "one real update on the longest record, save, restore, verify"),
                       ("train", "train the soft prompt (resumes from the newest committed checkpoint)")]:
        p = verbs.add_parser(verb, help=text)
        p.add_argument("config")
        p.set_defaults(run=cmd_train)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except SpdsError as error:
        print(f"spds {args.verb}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"spds {args.verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
