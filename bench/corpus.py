"""A corpus larger than the window, on the real example's model (SmolLM2-135M-Instruct, window
8,192): what a soft prompt carries past the window, against the teacher reading the corpus
truncated to it and the teacher reading the right slice (the oracle); and composition.

    python bench/corpus.py MODEL_DIR [--steps all|whole|halves|sweep] [--conversations N] [--out DIR]

The corpus: town fact sheets written from a seed (eight facts each: a 135M teacher states a sheet's
facts when it reads a few sheets), three windows of them, and a keyword question on every fourth
sheet, naming it (`doc`). All through the CLI: `spds generate` (self-study over each half, slices of
a few sheets), prepare, train, eval (soft / truncated / oracle). One set of rows serves every
prompt (a half's prompt its half's rows, a whole one both): the prompts are compared. Steps:
  whole   one embeddings prompt (128 positions) and one kv prompt (16) on the whole corpus (a
          prompt already trained in --out is evaluated again, not trained again);
  halves  one prompt per half (--half FORM:LENGTH), each evaluated alone on all 48 questions, and
          the two composed (`spds export --compose`), against the whole one;
  sweep   the compression sweep: a kv prompt of each --kv length on the whole corpus, started from
          its first tokens (--spread: every slice's), its facts, gap, and bytes against the KV cache
          of the whole corpus. A JSON line per figure.
--window N cuts the model's window (config.json) to N: three windows run end to end on a CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

SYLLABLES = "bar ken lo mir tas vel dun or rik sa mon tel gra fen hol ast bri cor lun pe".split()
RIVERS = "Amber Silt Heron Willow Copper Linden Slate Marsh Ember Fjell".split()
EXPORTS = "cheese timber wool salt glass honey copper paper rope cider".split()
MONTHS = "January February March April May June July August September October November December".split()
DESCRIPTION = "Fact sheets of the towns of the Varn valley: one sheet per town, eight facts each."


def town_sheets(seed: int):
    """Towns without end, each a sheet of eight facts and the question each fact answers (keyword)."""
    rng, names, count = random.Random(seed), set(), 0
    while True:
        name = "".join(rng.sample(SYLLABLES, 3)).capitalize() + rng.choice(["holm", "by", "stad", "wick"])
        mayor = "".join(rng.sample(SYLLABLES, 3)).capitalize()
        if name in names:
            continue
        names.add(name)
        bridges, tower, year = rng.randint(12, 98), rng.randint(20, 90), rng.randint(1100, 1899)
        river = rng.choice(RIVERS)
        export, month, club = rng.choice(EXPORTS), rng.choice(MONTHS), mayor[:3].capitalize() + "rovers"
        facts = [  # (fact, the question it answers, the keyword an answer holding it holds)
            (f"{name} lies on the {river} river.", f"Which river does {name} lie on?", river),
            (f"The mayor of {name} is {mayor}.", f"Who is the mayor of {name}?", mayor),
            (f"{name} was founded in {year}.", f"In what year was {name} founded?", str(year)),
            (f"The main export of {name} is {export}.", f"What is the main export of {name}?", export),
            (f"The festival of {name} is held every {month}.", f"In which month is {name}'s festival?", month),
            (f"{name} has {bridges} bridges.", f"How many bridges does {name} have?", str(bridges)),
            (f"The bell tower of {name} is {tower} metres tall.", f"How tall is {name}'s bell tower?", str(tower)),
            (f"{name}'s football club is the {club}.", f"What is {name}'s football club?", club),
        ]
        text = "".join(f"{i}. {fact}\n" for i, (fact, _, _) in enumerate(facts, start=1))
        yield dict(id=f"{count:03d}-{name.lower()}", title=f"Town of {name}", text=text, facts=facts)
        count += 1


def write_corpus(work: Path, model: Path, windows: int) -> list[dict]:
    """The towns (enough for `windows` windows of the model's tokens) as one file each, and the questions."""
    from transformers import AutoConfig, AutoTokenizer

    window = AutoConfig.from_pretrained(model).max_position_embeddings
    tokenizer = AutoTokenizer.from_pretrained(model)
    towns, tokens = [], 0
    for town in town_sheets(0):
        towns.append(town)
        tokens += len(tokenizer.encode(f"## {town['title']}\n{town['text']}\n\n", add_special_tokens=False))
        if tokens >= windows * window:
            break
    for half, members in (("a", towns[: len(towns) // 2]), ("b", towns[len(towns) // 2 :]), ("all", towns)):
        directory = work / f"corpus-{half}"
        directory.mkdir(exist_ok=True)
        with open(directory / "towns.jsonl", "w") as stream:
            stream.writelines(json.dumps({k: t[k] for k in ("id", "title", "text")}) + "\n" for t in members)
    with open(work / "questions.jsonl", "w") as stream:
        for n, town in enumerate(towns[::4][:48]):
            fact = n % 8
            _, asked, keyword = town["facts"][fact]
            question = dict(question_id=f"q{n:02d}", question=asked, keyword=keyword)
            stream.write(json.dumps(dict(question, doc=town["id"])) + "\n")
    (work / "corpus.json").write_text(json.dumps(dict(towns=len(towns), tokens=tokens, window=window)))
    common.record(figure="corpus", towns=len(towns), tokens=tokens, window=window, windows=round(tokens / window, 2))
    return towns


def config(work: Path, name: str, corpus: str, form: str, length: int, rate: float, args, rows: str = "") -> str:
    """A run's config: the real example's recipe on `corpus` (a, b or all); `rows`: which half's
    self-study rows it packs ("ab": both; default: its own corpus's)."""
    base = json.loads((common.REPO / "examples" / "real" / "run.json").read_text())
    base["student"].update(model_path="model", dtype=args.dtype)
    base["context"] = {"documents": f"corpus-{corpus}/towns.jsonl", "description": DESCRIPTION}
    base["soft_prompt"].update(form=form, length=length)
    base["soft_prompt"]["init"] = {"method": "context", "spread": args.spread}
    base["generate"].update(output=f"rows-{corpus}.jsonl", batch_size=args.batch, max_new_tokens=args.max_new_tokens)
    base["generate"]["self_study"].update(conversations=args.conversations // 2, slice_tokens=args.slice_tokens)
    # both halves' rows: half b's under ids of their own (each self-study run numbers from 0)
    candidates = (
        [{"path": "rows-a.jsonl"}, {"path": "rows-b-ids.jsonl"}] if rows == "ab" else [{"path": f"rows-{corpus}.jsonl"}]
    )
    base["data"].update(candidates=candidates, packed_dir=f"packed-{name}-{length}", context_limit=None)
    base["optim"].update(learning_rate=rate, updates=args.updates, effective_batch=args.rows, micro_batch=args.rows)
    base["optim"]["warmup_updates"] = min(4, args.updates)
    base["output_dir"] = f"run-{name}"
    questions = "questions.jsonl" if corpus == "all" else None
    base["eval"] = dict(base.get("eval", {}), questions=questions, samples=0, max_new_tokens=args.eval_tokens,
                        question_samples=args.question_samples, max_records=args.held_out)  # fmt: skip
    (work / f"{name}.json").write_text(json.dumps(base, indent=2))
    return f"{name}.json"


def spds(work: Path, *verb: str) -> None:
    log = work / f"{verb[-1].replace('/', '_')}-{verb[0]}.log"
    status, _ = common.timed([sys.executable, "-m", "spds.cli", *verb], log, cwd=work)
    if status:
        sys.exit(f"spds {' '.join(verb)} failed: {log}")


def evaluated(work: Path, name: str, variant: str, checkpoint: str | None = None) -> None:
    spds(work, "eval", f"{name}.json", *(["--checkpoint", checkpoint] if checkpoint else []))
    report = json.loads((work / f"run-{name}" / "eval.json").read_text())
    asked = report["questions"]
    hits = {view: round(share * asked["questions"]) for view, share in asked["keyword_share"].items()}
    common.record(figure="corpus quality", variant=variant, facts_of=asked["questions"], facts=hits,
                  questions_gap=asked["gap_recovered"], nll=asked["nll"], corpus=report.get("corpus"))  # fmt: skip
    if (work / f"run-{name}" / "metrics.jsonl").exists():  # eval's time and pace beside the step's
        common.eval_against_step(work / f"run-{name}", variant=variant)


def carried(work: Path, model: Path) -> None:
    """How many of the questions' facts the training rows state at all (an answer holding the
    keyword and its town's name, or a recital of its line): a prompt carries no fact its rows
    never state."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    answers = []
    for half in ("a", "b"):
        for line in open(work / f"rows-{half}.jsonl"):
            row = json.loads(line)
            answers.append(tokenizer.decode(row["labels"][row["prefix_tokens"] :], skip_special_tokens=True))
    questions = [json.loads(line) for line in open(work / "questions.jsonl")]
    stated = [q for q in questions if any(q["keyword"] in a and q["doc"].split("-")[1] in a.lower() for a in answers)]
    common.record(figure="corpus rows", rows=len(answers), questions=len(questions), facts_stated_in_rows=len(stated))


def trained(work: Path, name: str, form: str, length: int, rate: float, args, corpus: str = "all") -> str:
    """A prompt trained on the rows of both halves (corpus all) or of one, and its config."""
    updates = args.updates if corpus == "all" or args.half_updates is None else args.half_updates
    file = config(work, name, corpus, form, length, rate, argparse.Namespace(**dict(vars(args), updates=updates)),
                  rows="ab" if corpus == "all" else corpus)  # fmt: skip
    for verb in ("prepare", "train", "export"):
        spds(work, verb, file)
    return file


def compression(work: Path, name: str, form: str, length: int) -> None:
    """The prompt's bytes (bf16) against the KV cache of the whole corpus (what a user saves)."""
    from transformers import AutoConfig

    model = AutoConfig.from_pretrained(work / "model")
    kv_heads, head_dim = model.num_key_value_heads, model.head_dim or model.hidden_size // model.num_attention_heads
    per_token = model.num_hidden_layers * 2 * kv_heads * head_dim * 2  # keys and values, bf16
    prompt = length * (per_token if form == "kv" else model.hidden_size * 2)
    corpus = json.loads((work / "corpus.json").read_text())["tokens"]
    saved = round(corpus * per_token / prompt, 1)
    common.record(figure="corpus compression", variant=name, prompt_bytes=prompt, corpus_kv_bytes=corpus * per_token,
                  memory_saved=saved, tokens_per_position=round(corpus / length, 1))  # fmt: skip


def whole_prompt(work: Path, name: str, form: str, length: int, rate: float, args) -> None:
    """A prompt on the whole corpus (trained unless --out holds it already) and eval's figures."""
    if (work / f"run-{name}" / "export").is_dir():  # a rerun evaluates the prompt trained before
        config(work, name, "all", form, length, rate, args, rows="ab")
    else:
        trained(work, name, form, length, rate, args)
    evaluated(work, name, f"whole, {form} {length}")
    compression(work, name, form, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="examples/real/make_model.py's output")
    parser.add_argument("--steps", default="all", choices=("all", "whole", "halves", "sweep"))
    parser.add_argument("--kv", default="64,256,1024,2048", help="sweep: the kv prompt lengths")
    parser.add_argument("--spread", action="store_true", help="start from every slice's first tokens (init.spread)")
    parser.add_argument("--half", default="embeddings:128", help="halves: each half's prompt, FORM:LENGTH")
    parser.add_argument("--window", type=int, default=None, help="cut the model's window to this many positions")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="generate.max_new_tokens")
    parser.add_argument("--eval-tokens", type=int, default=64, help="eval.max_new_tokens: the greedy answers' length")
    parser.add_argument("--question-samples", type=int, default=4, help="eval.question_samples")
    parser.add_argument("--held-out", type=int, default=None, help="eval.max_records")
    parser.add_argument("--half-updates", type=int, default=None, help="a half's prompt's updates (default --updates)")
    parser.add_argument("--conversations", type=int, default=4096, help="self-study conversations on the whole corpus")
    parser.add_argument("--slice-tokens", type=int, default=640, help="generate.self_study.slice_tokens")
    parser.add_argument("--updates", type=int, default=256)
    parser.add_argument("--rows", type=int, default=64, help="optim.effective_batch")
    parser.add_argument("--batch", type=int, default=256, help="generate.batch_size")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--out", help="work directory (default: outside the checkout, bench/common.py)")
    args = parser.parse_args()
    work = common.out_dir(args.out, "corpus")
    if not (work / "model").exists() and args.window:  # the weights linked, the config's window cut
        (work / "model").mkdir()
        for file in Path(args.model).resolve().iterdir():
            (work / "model" / file.name).symlink_to(file)
        (work / "model" / "config.json").unlink()
        declared = json.loads((Path(args.model) / "config.json").read_text())
        (work / "model" / "config.json").write_text(json.dumps(dict(declared, max_position_embeddings=args.window)))
    if not (work / "model").exists():
        (work / "model").symlink_to(Path(args.model).resolve())
    began = time.time()
    write_corpus(work, work / "model", windows=3)
    for half in ("a", "b"):  # self-study rows of each half: its teacher read slices of its half only
        spds(work, "generate", config(work, f"rows-{half}", half, "embeddings", 128, 0.01, args))
    with open(work / "rows-b.jsonl") as rows, open(work / "rows-b-ids.jsonl", "w") as renamed:
        for line in rows:
            row = json.loads(line)
            renamed.write(
                json.dumps(dict(row, request_id="b-" + row["request_id"], question_id="b-" + row["question_id"])) + "\n"
            )
    carried(work, Path(args.model))
    whole = [("whole-emb", "embeddings", 128, 0.01), ("whole-kv", "kv", 16, 0.1)]
    if args.steps in ("all", "whole") or (args.steps == "sweep" and not args.spread):
        whole_prompt(work, *whole[0], args)
    if args.steps == "sweep":
        for length in [int(n) for n in args.kv.split(",")]:
            whole_prompt(work, f"sweep-kv-{length}{'-spread' * args.spread}", "kv", length, 0.1, args)
    form, length = args.half.split(":")
    length = int(length)
    rate = 0.1 if form == "kv" else 0.01
    if args.steps in ("all", "halves"):  # the halves composed first, then each alone
        for half in ("a", "b"):
            trained(work, f"half-{half}", form, length, rate, args, corpus=half)
        parts = [f"run-half-{h}/export/soft_prompt.safetensors" for h in ("a", "b")]
        spds(work, "export", "--compose", *parts, "composed")
        spds(work, "prepare", config(work, "composed", "all", form, 2 * length, rate, args, rows="ab"))
        evaluated(work, "composed", "halves composed", "composed/soft_prompt.safetensors")
    if args.steps in ("all", "whole"):
        whole_prompt(work, *whole[1], args)
    if args.steps in ("all", "halves"):
        for half in ("a", "b"):  # each half's prompt alone, read on every question of the corpus
            file = config(work, f"alone-{half}", "all", form, length, rate, args, rows="ab")
            spds(work, "prepare", file)
            evaluated(work, f"alone-{half}", f"half {half} alone", f"run-half-{half}/export/soft_prompt.safetensors")
    common.record(figure="corpus bench", seconds=round(time.time() - began))


if __name__ == "__main__":
    main()
