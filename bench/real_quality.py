"""What a soft prompt carries on questions training never asked, recomputed with plain
transformers and PyTorch: nothing here imports spds.

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
With --recite, also whether each view holds a fact at all, asked the way the recite kind asks:
for each question, the context's line holding its keyword is quoted from its first four words,
and the greedy recitation counts when it holds the keyword (a line whose first four words hold
it already is left out). A prompt that recites a fact it does not answer holds the fact and not
the way to it.

    python bench/real_quality.py MODEL CONTEXT QUESTIONS [--prompt soft_prompt.safetensors]
"""

from __future__ import annotations

import argparse
import json
import time

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


RECITAL_ASK = 'Quote the document word for word from "{start}" on.'  # spds's first recite phrasing


def recitals(model, tokenizer, context: str, questions: list[dict], views: dict, at: int, max_new_tokens: int) -> dict:
    """Per view, of the questions whose keyword's line does not hold it in its first four words:
    how many greedy recitations from those words hold the keyword, and how many were asked."""
    asked = []
    for question in questions:
        keyword = question.get("keyword", "").lower()
        line = next((line for line in context.splitlines() if keyword and keyword in line.lower()), None)
        start = " ".join(line.split()[:4]) if line else ""
        if line and keyword not in start.lower():
            asked.append((keyword, question_ids(tokenizer, RECITAL_ASK.format(start=start))))
    counts = {}
    for view, block in views.items():
        said = answers(model, tokenizer, [embeds(model, ids, at, block) for _, ids in asked], max_new_tokens, False, 0)
        texts = [tokenizer.decode(ids, skip_special_tokens=True).lower() for ids in said]
        counts[view] = sum(keyword in text for (keyword, _), text in zip(asked, texts))
    return dict(counts, asked=len(asked))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("context")
    parser.add_argument("questions")
    parser.add_argument("--prompt", help="soft_prompt.safetensors (spds export); without it, floor and ceiling only")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", help="write the figures and answers here")
    parser.add_argument("--recite", action="store_true", help="also count the facts each view recites")
    args = parser.parse_args()
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
    recited = recitals(model, tokenizer, context, questions, views, at, args.max_new_tokens) if args.recite else None
    figures = {name: total / tokens for name, total in sums.items()}
    gap = (figures["floor"] - figures["soft"]) / (figures["floor"] - figures["ceiling"]) if "soft" in figures else None
    result = dict(
        nll=figures,
        gap_recovered=gap,
        keyword_hits=hits,
        questions=len(questions),
        answer_tokens=tokens,
        **({"recited": recited} if recited else {}),
        seconds=time.time() - began,
    )
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(dict(result, answers=rows), stream, indent=1)


if __name__ == "__main__":
    main()
