"""How many of self-study's fact rows state the fact their question was written from: for each
line of the context, the fact rows written from it and those whose answer holds the line's keyword
(the keyword of the held-out question about that line; where a line holds several, the one
fewest lines of the context hold). Reads the rows as bench/gpu_self_study.sh keeps them
(OUT/written.jsonl[.gz]: each row's self_study record and its answer's text).

    python3 bench/fact_row_yield.py WRITTEN MODEL_DIR CONTEXT QUESTIONS
"""

from __future__ import annotations

import gzip
import json
import sys

from transformers import AutoTokenizer


def main(written: str, model: str, context: str, questions: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer.encode(open(context, encoding="utf-8").read(), add_special_tokens=False)
    keywords = [json.loads(line)["keyword"] for line in open(questions, encoding="utf-8") if line.strip()]
    opener = gzip.open if written.endswith(".gz") else open
    rows = [json.loads(line) for line in opener(written, "rt", encoding="utf-8")]
    lines = tokenizer.decode(ids).lower().splitlines()
    spread = {k: sum(k.lower() in line for line in lines) for k in keywords}  # lines holding each keyword
    per_line: dict[str, list] = {}  # line -> [keyword, rows stating it, rows]
    for row in (r for r in rows if r["kind"] == "fact"):
        line = tokenizer.decode(ids[row["line"][0] : row["line"][1]]).strip()
        found = sorted((k for k in keywords if k.lower() in line.lower()), key=spread.get)  # the rarest first
        entry = per_line.setdefault(line, [found[0] if found else None, 0, 0])
        entry[1] += entry[0] is not None and entry[0].lower() in row["answer"].lower()
        entry[2] += 1
    stated, total = sum(e[1] for e in per_line.values()), sum(e[2] for e in per_line.values())
    print(f"{stated} of {total} fact rows state their line's keyword ({stated / max(total, 1):.0%})")
    for line, (keyword, hits, count) in sorted(per_line.items(), key=lambda item: item[1][1] / item[1][2]):
        print(f"  {hits:3d} of {count:3d}  {keyword}  | {line[:60]}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
