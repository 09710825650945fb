"""spds sample: see the effect, not only the NLL.

Answers by the student three ways, side by side: bare (nothing where the prompt goes, eval's
floor), with the context's tokens there (eval's ceiling, what the teacher saw), and with the
trained soft prompt, for held-out records (their prompts as packed) or the questions of a file
(rendered by the chat template and placed by training's rule, spds.export.insertion_point).
Greedy decoding, so a rerun gives the same answers. Written to OUTPUT_DIR/samples.jsonl and
samples.md beside eval.json, and printed; `spds eval` includes a few (eval.samples).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from spds.contract.config import Config
from spds.data.chat import end_token_ids
from spds.data.packed import PackedStore
from spds.data.sources import read_questions
from spds.data.student_files import load_tokenizer
from spds.errors import SpdsError
from spds.export import insertion_point
from spds.fsio import atomic_writer
from spds.model.student import load_student
from spds.training.checkpoint import checkpoint_to_read, prompt_of

VIEWS = ("bare", "context", "soft")
TITLES = {"bare": "bare student", "context": "with the context", "soft": "with the soft prompt"}


def prompts_to_answer(config: Config, store: PackedStore, tokenizer, count: int, questions: Path | None):
    """(what is asked, the prompt ids, where the prompt goes) for each question to answer."""
    if questions is not None:
        metadata = {"placement": store.manifest["placement"], "scaffold": store.manifest["scaffold"]}
        kwargs = config.data.chat_template_kwargs
        for question in read_questions(questions)[:count]:
            ids = tokenizer.apply_chat_template(
                question["messages"], tokenize=True, add_generation_prompt=True, return_dict=False, **kwargs
            )
            ids, at = insertion_point([int(i) for i in ids], metadata)
            yield question["messages"][-1]["content"], ids, at
        return
    held_out = np.flatnonzero(~store.is_train)
    if not len(held_out):
        raise SpdsError(
            "no held-out records to answer: set data.eval_fraction > 0 (and prepare a fresh packed_dir) "
            "or pass --questions FILE"
        )
    seen = set()  # a question's samples share its prompt: answer each prompt once
    for i in held_out:
        ids = store.ids(int(i))[: int(store.prefix_tokens[i])].tolist()
        if tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        at = int(store.insert_at[i])
        yield asked_text(tokenizer, ids, at, store.manifest), ids, at
        if len(seen) == count:
            return


def asked_text(tokenizer, ids: list[int], at: int, manifest: dict) -> str:
    """The user's question in a packed prompt: the text after its last user header up to that
    turn's end token (not the template's default system text, nor the headers)."""
    header, ends = manifest["scaffold"]["user_header"], set(manifest["end_token_ids"])
    start = at
    for i in range(len(ids) - len(header), at - 1, -1):
        if header and ids[i : i + len(header)] == header:
            start = i + len(header)
            break
    stop = next((i for i in range(start, len(ids)) if ids[i] in ends), len(ids))
    return tokenizer.decode(ids[start:stop], skip_special_tokens=True).strip()


@torch.no_grad()
def answers(
    config: Config,
    count: int,
    questions: Path | None = None,
    checkpoint: str | None = None,
    max_new_tokens: int = 64,
    student=None,
) -> list[dict]:
    directory = checkpoint_to_read(config.output_dir, checkpoint)
    prompt, commit = prompt_of(directory)
    store = PackedStore.open(config.packed_dir)
    tokenizer = load_tokenizer(config)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    student = student or load_student(
        config.model_path, config.student.dtype, "sdpa", device, config.student.trust_remote_code
    )
    embed = student.get_input_embeddings()
    context = config.context_text
    blocks = {"bare": prompt[:0], "soft": prompt}
    if context:
        blocks["context"] = embed(
            torch.tensor(tokenizer.encode(context, add_special_tokens=False), device=embed.weight.device)
        )
    end_ids = end_token_ids(tokenizer, config.data.end_tokens)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]
    rows = []
    for asked, ids, at in prompts_to_answer(config, store, tokenizer, count, questions):
        tokens = embed(torch.tensor(ids, device=embed.weight.device))
        row = dict(question=asked, checkpoint=str(directory), update=commit["update"])
        for view in VIEWS:
            if view not in blocks:
                row[view] = None  # no context in the config: nothing to compare with
                continue
            block = blocks[view].to(device=tokens.device, dtype=tokens.dtype)
            inputs = torch.cat([tokens[:at], block, tokens[at:]])[None]
            mask = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)
            output = student.generate(
                inputs_embeds=inputs,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=end_ids,
                pad_token_id=pad,
            )
            row[view] = tokenizer.decode(output[0], skip_special_tokens=True).strip()
        rows.append(row)
    return rows


def write(out: Path, rows: list[dict]) -> tuple[Path, Path]:
    with atomic_writer(out / "samples.jsonl") as stream:
        stream.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    with atomic_writer(out / "samples.md") as stream:
        stream.write(render_markdown(rows))
    return out / "samples.jsonl", out / "samples.md"


def render_markdown(rows: list[dict]) -> str:
    lines = [f"# Answers at update {rows[0]['update']}" if rows else "# Answers", ""]
    for number, row in enumerate(rows, start=1):
        lines += [f"## {number}. {one_line(row['question'], 200)}", ""]
        lines += [f"**{TITLES[view]}:** {row[view]}\n" for view in VIEWS if row[view] is not None]
    return "\n".join(lines)


def one_line(text: str, width: int) -> str:
    """For the terminal: whitespace collapsed, what cannot be shown as a dot (a random tiny
    student answers in arbitrary bytes), cut to `width`."""
    text = " ".join(text.split())
    text = "".join(c if c.isprintable() and c != "\ufffd" else "·" for c in text)
    return text if len(text) <= width else text[: width - 1] + "…"


def show(rows: list[dict], width: int = 100) -> str:
    """Side by side in the terminal: one block per question."""
    text = []
    for row in rows:
        text += ["─" * width, f"Q: {one_line(row['question'], width - 3)}"]
        text += [f"  {view:8s}│ {one_line(row[view], width - 12)}" for view in VIEWS if row[view] is not None]
    return "\n".join(text)
