"""How sure the teacher itself is of each fact, and where a soft prompt's greedy answer leaves it:
along the context's greedy answer to each fact question (from a bench/real_quality.py --json
file), the probability of each token of the question's keyword under the teacher (the model with
the context) and under the soft prompt, with the soft prompt's most likely token where it is
another. Plain transformers, the layout bench/real_quality.py writes out; nothing from spds.

    python bench/fact_token_probs.py MODEL CONTEXT QUESTIONS FIGURES.json soft_prompt.safetensors
"""

from __future__ import annotations

import argparse
import json

import torch
from real_quality import embeds, question_ids, system_header_end
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("model", "context", "questions", "figures", "prompt"):
        parser.add_argument(name)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    table = model.get_input_embeddings()
    context = table(torch.tensor(tokenizer.encode(open(args.context).read(), add_special_tokens=False)))
    prompt = load_file(args.prompt)["prompt"].float()
    keywords = {q["question_id"]: q["keyword"] for q in map(json.loads, open(args.questions))}
    unsure = []
    for row in json.load(open(args.figures))["answers"]:
        keyword, answer_text = keywords[row["question_id"]], row["context"]
        start = answer_text.lower().find(keyword.lower())
        if start < 0:
            continue  # the context's own answer misses it: no fact to carry
        ids = question_ids(tokenizer, row["question"])
        header = system_header_end(tokenizer, ids)
        answer = tokenizer.encode(answer_text, add_special_tokens=False)

        @torch.no_grad()
        def along(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """The probability of each answer token with `block` after the system header, and the
            most likely token there."""
            inputs = embeds(model, ids + answer, header, block)
            probs = model(inputs_embeds=inputs[None]).logits[0, -len(answer) - 1 : -1].float().softmax(-1)
            return probs[torch.arange(len(answer)), torch.tensor(answer)], probs.argmax(-1)

        teacher, _ = along(context)
        soft, choice = along(prompt)
        ends = [len(tokenizer.decode(answer[:i])) for i in range(len(answer) + 1)]  # each token's text span
        inside = [i for i in range(len(answer)) if ends[i + 1] > start and ends[i] < start + len(keyword)]
        held = keyword.lower() in row["soft"].lower()
        shown = " ".join(
            f"{tokenizer.decode([answer[i]])!r} {teacher[i]:.2f}/{soft[i]:.2f}"
            + ("" if choice[i] == answer[i] else f" ->{tokenizer.decode([int(choice[i])])!r}")
            for i in inside
        )
        print(f"{row['question_id']:10s} soft prompt {'holds' if held else 'misses'} it: {shown}")
        unsure.append(min(float(teacher[i]) for i in inside))
    below = sum(p < 0.6 for p in unsure)
    print(f"facts whose least likely keyword token the teacher itself gives < 0.6: {below} of {len(unsure)}")


if __name__ == "__main__":
    main()
