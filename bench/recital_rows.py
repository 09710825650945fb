"""Issue 44 probe: recital rows, whose answer is the context's own text.

A 135M teacher states barely half of a fact sheet's facts when asked, and its self-study answers
state the later facts in a few rows of a thousand: a prompt cannot learn a fact its rows never
say. A recital row asks the student to quote the context from a line's first words on, and its
answer is the literal text (the line and the next ones): every fact, stated exactly, as often as
the rows are drawn. Trained with the online teacher (loss.teacher context) or CE, as these rows
carry no top-k.
    python bench/recital_rows.py MODEL CONTEXT OUT.jsonl [--copies N] [--lines N]
"""

import argparse
import hashlib
import json

from transformers import AutoTokenizer

ASK = [
    'Quote the document word for word from "{start}" on.',
    'What does the document say, word for word, starting at "{start}"?',
    'Repeat the part of the document that begins "{start}".',
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("context")
    parser.add_argument("out")
    parser.add_argument("--copies", type=int, default=4, help="each (line, phrasing) row this many times")
    parser.add_argument("--lines", type=int, default=3, help="lines of the context in one answer")
    parser.add_argument("--words", type=int, default=4, help="words of the line's start in the question")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    lines = [line for line in open(args.context).read().splitlines() if line.strip()]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    written = 0
    with open(args.out, "w") as out:
        for i, line in enumerate(lines):
            start = " ".join(line.split()[: args.words])
            text = "\n".join(lines[i : i + args.lines])
            for p, ask in enumerate(ASK):
                messages = [{"role": "user", "content": ask.format(start=start)}]
                prompt = tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
                response = tokenizer.encode(text, add_special_tokens=False) + [end]
                for c in range(args.copies):
                    qid = f"recital-{i:03d}-{p}"
                    out.write(
                        json.dumps(
                            dict(
                                request_id=f"{qid}-s{c}",
                                question_id=qid,
                                sample_index=c,
                                input_ids=prompt + response,
                                prefix_tokens=len(prompt),
                                labels=[-100] * len(prompt) + response,
                                supervised_tokens=len(response),
                                response_sha256=hashlib.sha256(text.encode()).hexdigest(),
                            )
                        )
                        + "\n"
                    )
                    written += 1
    print(f"recital rows: {written} ({len(lines)} lines x {len(ASK)} phrasings x {args.copies})")


if __name__ == "__main__":
    main()
