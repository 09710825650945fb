"""What a soft prompt carries on questions training never asked, on the real example's model
(SmolLM2-135M-Instruct, examples/real: `make demo-real` builds it), in two ways:

    python bench/quality.py forms MODEL_DIR [NAME=form:length:learning_rate ...]
    python bench/quality.py recompute MODEL CONTEXT QUESTIONS [--prompt soft_prompt.safetensors]

`forms` trains one prompt per variant through the CLI as a user would (examples/real/run.json, the
CPU recipe: 256 self-study conversations, kl to the top-20, 64 updates of 8; the rows generated
once) and prints spds eval's figures on the 20 fact questions training never asks: the gap
recovered and the share of greedy answers holding the fact's keyword. Default variants: both
forms, embeddings at 128 positions (lr 0.01) and kv at 16 (lr 0.1).

`recompute` recomputes those figures for an embeddings prompt with plain transformers and
PyTorch: nothing it runs imports spds.

For each question of a questions file (question_id, question, keyword), on the student model:
  * the teacher (the model with the context as its system message) answers it `--samples` times
    by sampling (transformers' generate, seeded), and greedily once;
  * the NLL per token of those sampled answers under three students, each the published chat
    template's rendering of the question with no system message (the template's default system
    text then stands in the system message), with, right after the system header,
        floor    nothing,
        ceiling  the context's tokens,
        soft     the trained soft prompt's vectors (soft_prompt.safetensors, tensor "prompt");
    gap recovered = (floor - soft) / (floor - ceiling);
  * greedy answers by the same three, and the share of them holding the keyword (case-insensitive).
This is the layout spds trains with placement "system" and data.missing_system "template" (the
prompt inside the system message, before the default text), written out here by its tokens.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def system_header_end(tokenizer, ids: list[int]) -> int:
    """Where the system message's content starts: after the template's first system header,
    found as the tokens the template renders before a sentinel system content."""
    probe = tokenizer.apply_chat_template(
        [{"role": "system", "content": "SENTINEL-7f3"}, {"role": "user", "content": "x"}],
        tokenize=False,
    )
    header = probe[: probe.index("SENTINEL-7f3")]
    header_ids = tokenizer.encode(header, add_special_tokens=False)
    assert ids[: len(header_ids)] == header_ids, "the rendering does not open with the system header"
    return len(header_ids)


def question_ids(tokenizer, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": question}
    ]
    return [int(i) for i in tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)]


def embeds(model, ids: list[int], at: int, block: torch.Tensor | None) -> torch.Tensor:
    table = model.get_input_embeddings()
    tokens = table(torch.tensor(ids, device=model.device))
    if block is None:
        return tokens
    return torch.cat([tokens[:at], block.to(tokens.dtype), tokens[at:]])


@torch.no_grad()
def nll(model, prompt_embeds: torch.Tensor, answer: list[int]) -> tuple[float, int]:
    """Summed NLL of `answer` after the prompt, and its token count."""
    answer_embeds = model.get_input_embeddings()(torch.tensor(answer, device=model.device))
    inputs = torch.cat([prompt_embeds, answer_embeds])[None]
    logits = model(inputs_embeds=inputs).logits[0, prompt_embeds.shape[0] - 1 : -1].float()
    target = torch.tensor(answer, device=model.device)
    return float(torch.nn.functional.cross_entropy(logits, target, reduction="sum")), len(answer)


@torch.no_grad()
def answers(
    model, tokenizer, prompts: list[torch.Tensor], max_new_tokens: int, sample: bool, seed: int
) -> list[list[int]]:
    """transformers' generate over the prompts (embeddings), left-padded into one batch; each
    answer up to and including its end token."""
    torch.manual_seed(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    ends = [t for t in {end, tokenizer.eos_token_id} if t is not None]
    longest = max(p.shape[0] for p in prompts)
    batch = prompts[0].new_zeros(len(prompts), longest, prompts[0].shape[1])
    mask = torch.zeros(len(prompts), longest, dtype=torch.long, device=model.device)
    for row, prompt in enumerate(prompts):
        batch[row, longest - prompt.shape[0] :] = prompt
        mask[row, longest - prompt.shape[0] :] = 1
    out = model.generate(
        inputs_embeds=batch,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        do_sample=sample,
        temperature=0.7 if sample else None,
        top_p=0.95 if sample else None,
        top_k=None,
        eos_token_id=ends,
        pad_token_id=ends[0],
    )
    result = []
    for row in out.tolist():
        stop = next((i for i, t in enumerate(row) if t in ends), None)
        result.append(row[: stop + 1] if stop is not None else row)
    return result


def recompute(args) -> None:
    began = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype)).to(device).eval()
    context = open(args.context, encoding="utf-8").read()
    questions = [json.loads(line) for line in open(args.questions, encoding="utf-8") if line.strip()]
    table = model.get_input_embeddings()
    blocks = {
        "floor": None,
        "ceiling": table(torch.tensor(tokenizer.encode(context, add_special_tokens=False), device=device)),
    }
    if args.prompt:
        blocks["soft"] = load_file(args.prompt)["prompt"].to(device)
    sums = {name: 0.0 for name in blocks}
    tokens = 0
    hits = {"bare": 0, "context": 0, **({"soft": 0} if args.prompt else {})}
    rows = []
    teacher_prompts = [embeds(model, question_ids(tokenizer, q["question"], context), 0, None) for q in questions]
    sampled = answers(model, tokenizer, teacher_prompts * args.samples, args.max_new_tokens, True, seed=1)
    student_ids = [question_ids(tokenizer, q["question"]) for q in questions]
    at = system_header_end(tokenizer, student_ids[0])
    for number, ids in enumerate(student_ids):
        for sample in sampled[number :: len(questions)]:
            tokens += len(sample)
            for name, block in blocks.items():
                sums[name] += nll(model, embeds(model, ids, at, block), sample)[0]
    views = {"bare": None, "context": blocks["ceiling"], **({"soft": blocks["soft"]} if args.prompt else {})}
    greedy = {
        view: answers(
            model, tokenizer, [embeds(model, ids, at, block) for ids in student_ids], args.max_new_tokens, False, 0
        )
        for view, block in views.items()
    }
    for number, question in enumerate(questions):
        row = dict(question_id=question["question_id"], question=question["question"])
        for view in views:
            row[view] = tokenizer.decode(greedy[view][number], skip_special_tokens=True).strip()
            hits[view] += question.get("keyword", "\0").lower() in row[view].lower()
        rows.append(row)
    figures = {name: total / tokens for name, total in sums.items()}
    gap = (figures["floor"] - figures["soft"]) / (figures["floor"] - figures["ceiling"]) if "soft" in figures else None
    result = dict(
        nll=figures,
        gap_recovered=gap,
        keyword_hits=hits,
        questions=len(questions),
        answer_tokens=tokens,
        seconds=time.time() - began,
    )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    common.record(figure="quality (plain transformers)", **result)
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(dict(result, answers=rows), stream, indent=1)


def forms(args) -> None:
    """Train each variant through the CLI on one set of self-study rows; record eval's figures."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import common

    real = common.REPO / "examples" / "real"
    work = common.out_dir(args.out, "quality")
    for name in ("context.md", "questions.jsonl", "run.json"):
        shutil.copy(real / name, work / name)
    if not (work / "model").exists():
        (work / "model").symlink_to(Path(args.model).resolve())
    spds = [sys.executable, "-m", "spds.cli"]
    status, seconds = common.timed([*spds, "generate", "run.json"], work / "generate.log", cwd=work)  # kept rows stay
    if status:
        sys.exit(f"spds generate failed: {work / 'generate.log'}")
    for variant in args.variants:
        name, spec = variant.split("=")
        form, length, rate = spec.split(":")
        config = json.loads((work / "run.json").read_text())
        config["soft_prompt"].update(form=form, length=int(length))
        config["optim"]["learning_rate"] = float(rate)
        config["data"]["packed_dir"] = f"packed-{length}"  # a store is packed for a prompt length
        config["output_dir"] = f"run-{name}"
        (work / f"{name}.json").write_text(json.dumps(config, indent=2))
        began = time.time()
        for verb in ("prepare", "train", "eval"):
            status, _ = common.timed([*spds, verb, f"{name}.json"], work / f"{name}-{verb}.log", cwd=work)
            if status:
                sys.exit(f"spds {verb} failed: {work / f'{name}-{verb}.log'}")
        report = json.loads((work / f"run-{name}" / "eval.json").read_text())
        asked = report["questions"]
        common.record(
            figure="quality",
            variant=name,
            form=form,
            length=int(length),
            learning_rate=float(rate),
            questions_gap=asked["gap_recovered"],
            keyword_share=asked.get("keyword_share"),
            held_out_gap=report["gap_recovered"],
            seconds=round(time.time() - began),
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="tool", required=True)
    trained = verbs.add_parser("forms", help="train variants through the CLI; eval's figures")
    trained.add_argument(
        "model", help="examples/real/make_model.py's output (make demo-real: examples/real/build/model)"
    )
    trained.add_argument("variants", nargs="*", default=["emb128=embeddings:128:0.01", "kv16=kv:16:0.1"])
    trained.add_argument("--out", help="work directory (default: outside the checkout, bench/common.py)")
    trained.set_defaults(run=forms)
    plain = verbs.add_parser("recompute", help="the figures recomputed with plain transformers")
    plain.add_argument("model")
    plain.add_argument("context")
    plain.add_argument("questions")
    plain.add_argument("--prompt", help="soft_prompt.safetensors (spds export); without it, floor and ceiling only")
    plain.add_argument("--samples", type=int, default=4)
    plain.add_argument("--max-new-tokens", type=int, default=48)
    plain.add_argument("--dtype", default="float32")
    plain.add_argument("--json", help="write the figures and answers here")
    plain.set_defaults(run=recompute)
    args = parser.parse_args()
    args.run(args)


if __name__ == "__main__":
    main()
