"""The whole loop on a tiny student for published chat templates, one process for many runs.

    python tests/template_runs.py OUT NAME:PLACEMENT[:FAMILY] ...

For each case: a tiny random student of the template's decoder family (or FAMILY;
tests/fixtures/models) with a tokenizer holding the template and its tokens (tests/fixtures/templates),
teacher rows in both forms (token rows as a teacher writes them, chat rows spds renders), then
prepare -> smoke -> train -> eval -> export -> an answer through spds.trained.export.generate and
spds sample's three views of two held-out questions, through
spds's library functions (the CLI's own verbs are tested elsewhere; one process keeps dozens of
runs to seconds each). Writes OUT/results.json: per case, what each step reported.
"""

from __future__ import annotations

import hashlib
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples" / "tiny"))

import make_tiny  # noqa: E402
from test_families import FAMILIES, save_family  # noqa: E402
from test_templates import TEMPLATES, end_token, fixture_tokenizer  # noqa: E402

CONTEXT = "Lumen Bay ferries leave at dawn and dusk."


def rows_for(name: str, tokenizer, kwargs: dict, count: int = 16) -> list[dict]:
    """Teacher rows: token rows (prompt rendered by the template, the answer, the turn end) and
    every fourth in chat form; some with a system message where the template has one."""
    from spds.data.chat import render

    has_system = TEMPLATES[name]["system_role"] in ("optional", "always")  # a block of its own
    rows = []
    for i in range(count):
        subject = make_tiny.SUBJECTS[i % len(make_tiny.SUBJECTS)]
        question = f"Tell me about the {subject} (note {i})."
        answer = f"The {subject} {make_tiny.FACTS[i % len(make_tiny.FACTS)]}. Archived."
        messages = [{"role": "user", "content": question}]
        if has_system and i % 5 == 0:
            messages = [{"role": "system", "content": "Be brief."}, *messages]
        request = dict(request_id=f"q{i:03d}-s0", question_id=f"q{i:03d}", sample_index=0)
        if i % 4 == 3:
            rows.append(dict(request, messages=messages, response=answer))
            continue
        prompt = render(tokenizer, messages, True, kwargs)
        response = tokenizer.encode(answer, add_special_tokens=False) + [end_token(tokenizer, name)]
        rows.append(
            dict(
                request,
                input_ids=prompt + response,
                prefix_tokens=len(prompt),
                labels=[-100] * len(prompt) + response,
                supervised_tokens=len(response),
                response_sha256=hashlib.sha256(answer.encode()).hexdigest(),
            )
        )
    return rows


def run_case(out: Path, name: str, placement: str, family: str) -> dict:
    import torch

    from spds.contract.gate import load_config
    from spds.data.packed import PackedStore
    from spds.data.prepare import prepare
    from spds.model.student import load_student
    from spds.trained.evaluate import evaluate
    from spds.trained.export import export, generate, load_soft_prompt
    from spds.trained.sample import answers
    from spds.training.train import run

    directory = out / f"{name}-{placement}-{family}"
    tokenizer = fixture_tokenizer(name)
    kwargs = TEMPLATES[name].get("kwargs", {})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    save_family(directory / "student", family, len(tokenizer), end_token(tokenizer, name), pad)
    tokenizer.save_pretrained(directory / "student")
    attention = FAMILIES[family]["attn_implementation"]
    make_tiny.write_jsonl(directory / "rows.jsonl", rows_for(name, tokenizer, kwargs))
    config = {
        "student": {"model_path": "student", "dtype": "float32", "attn_implementation": attention},
        "soft_prompt": {"length": 3, "placement": placement, "init": {"method": "random_normal", "std": 0.1}},
        "data": {
            "candidates": [{"path": "rows.jsonl"}],
            "packed_dir": "packed",
            "context_limit": 2048,
            "eval_fraction": 0.3,
            "chat_template_kwargs": kwargs,
        },
        "context": {"text": CONTEXT},
        "optim": {
            "updates": 2,
            "effective_batch": 4,
            "micro_batch": 2,
            "learning_rate": 0.01,
            "seed": 1,
            # records end to end in one forward wherever spds computes the attention
            "micro_batch_layout": "packed" if attention == "sdpa" else "padded",
        },
        "checkpoint": {"every": 2, "keep_last": 1},
        "train": {"progress_bar": False},
        "output_dir": "run",
    }
    (directory / "config.json").write_text(json.dumps(config))
    result = {}
    loaded = load_config(directory / "config.json")
    manifest = prepare(loaded, log=lambda *_: None)
    store = PackedStore.open(loaded.packed_dir)
    # q001: a token row without a system message, rendered by the template as a teacher would
    row = next(i for i, entry in enumerate(store.entries()) if entry["request_id"] == "q001-s0")
    result["placed_prefix"] = tokenizer.decode(store.ids(row)[: int(store.insert_at[row])].tolist())
    result["counts"] = manifest["counts"]
    result["smoke"] = run(loaded, smoke=True)["status"]
    result["train"] = run(loaded, smoke=False)["status"]
    report = evaluate(loaded, None, log=lambda *_: None)
    result["nll"] = report["nll"]
    exported = export(loaded, None, loaded.output_dir / "export")
    prompt, metadata = load_soft_prompt(exported["soft_prompt"])
    student = load_student(loaded.model_path, "float32", attention, torch.device("cpu"))
    result["answer"] = generate(
        student,
        tokenizer,
        prompt,
        metadata,
        [{"role": "user", "content": "Tell me more."}],
        max_new_tokens=3,
        do_sample=False,
    )
    result["samples"] = answers(loaded, 2, max_new_tokens=3, student=student)  # spds sample's three views
    return result


def main(out: Path, cases: list[str]) -> None:
    results = {}
    for case in cases:
        name, placement, *family = case.split(":")
        try:
            results[case] = run_case(out, name, placement, family[0] if family else TEMPLATES[name]["family"])
        except Exception:
            results[case] = {"error": traceback.format_exc()[-3000:]}
    (out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
