"""The distillation loop around training: generate, eval, export."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest
import torch
from conftest import edit_config, make_tiny
from helpers import FAST, ROUNDING, assert_rounding_close, check, final_state, read_json, spds
from transformers import AutoModelForCausalLM

from spds.contract.gate import load_config, section
from spds.data.packed import PackedStore
from spds.model.student import load_student
from spds.trained.export import insertion_point, load_soft_prompt, splice
from spds.trained.sample import VIEWS


@pytest.fixture
def loop_dir(tiny_assets, tmp_path):
    """The tiny loop config (generate -> ... -> export), with its own copy of the inputs."""
    for name in ("questions.jsonl",):
        shutil.copy(tiny_assets / name, tmp_path / name)
    config = json.loads((tiny_assets / "loop.json").read_text())
    config["student"]["model_path"] = str(tiny_assets / "student")
    (tmp_path / "config.json").write_text(json.dumps(config, indent=2))
    return tmp_path


@pytest.mark.slow
def test_generate_is_deterministic_and_resumes_after_a_torn_write(loop_dir, tmp_path_factory):
    check(spds(["generate", "config.json"], loop_dir))
    output = loop_dir / "generated.jsonl"
    first = output.read_bytes()
    rows = [json.loads(line) for line in first.splitlines()]
    assert len(rows) == 64 and len({r["request_id"] for r in rows}) == 64
    assert all(r["input_ids"][r["prefix_tokens"] :] == r["labels"][r["prefix_tokens"] :] for r in rows)
    # The student-side prompt has no context: the context's words never appear in it.
    tokenizer = make_tiny.chatml_tokenizer()
    assert all("Lumen Bay" not in tokenizer.decode(r["input_ids"][: r["prefix_tokens"]]) for r in rows)
    # A crash mid-write: 20 whole lines and half of the 21st.
    lines = first.splitlines(keepends=True)
    output.write_bytes(b"".join(lines[:20]) + lines[20][: len(lines[20]) // 2])
    result = check(spds(["generate", "config.json"], loop_dir))
    assert "20 were already there" in result.stdout
    assert output.read_bytes() == first
    # The generated rows are valid candidates.
    check(spds(["prepare", "config.json"], loop_dir))


@pytest.mark.slow
def test_generate_writes_the_teachers_top_k_and_prepare_packs_them(loop_dir):
    """generate.top_k_logprobs: each row carries, per supervised token, the teacher's k most
    likely next tokens and their log-probabilities, recomputed here with a plain forward of the
    teacher (the student with the context as system message) over the same ids."""
    from transformers import AutoModelForCausalLM

    edit_config(
        loop_dir,
        generate={**read_json(loop_dir / "config.json")["generate"], "top_k_logprobs": 4, "output": "top-k.jsonl"},
        data={
            "candidates": [{"path": "top-k.jsonl"}],
            "packed_dir": "packed-top-k",
            "context_limit": 4096,
            "eval_fraction": 0.25,
        },
        loss={"objective": "kl", "teacher": "top_k"},
    )
    check(spds(["generate", "config.json"], loop_dir))
    rows = [json.loads(line) for line in (loop_dir / "top-k.jsonl").read_text().splitlines()]
    row = rows[5]
    top = row["top_logprobs"]
    assert len(top["ids"]) == row["supervised_tokens"] and {len(ids) for ids in top["ids"]} == {4}
    config = load_config(loop_dir / "config.json")
    teacher = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=getattr(torch, config.student.dtype))
    tokenizer = make_tiny.chatml_tokenizer()
    assert "Lumen Bay" not in tokenizer.decode(row["input_ids"][: row["prefix_tokens"]])  # the teacher's prompt had it
    question = next(q["question"] for q in read_rows_questions(loop_dir) if q["question_id"] == row["question_id"])
    messages = [{"role": "system", "content": make_tiny.CONTEXT}, {"role": "user", "content": question}]
    prompt = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    response = row["input_ids"][row["prefix_tokens"] :]
    with torch.no_grad():
        logits = teacher(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1]
    plain = torch.log_softmax(logits.float(), dim=-1)
    expected = plain.topk(4, dim=-1)
    # The teacher's logits come out of its head rounded to its dtype: in bf16 to 8 bits, so two
    # orders of summation (spds's attention against transformers') may land an ulp or two of the
    # largest logit apart, and two tokens that close may trade ranks. So each token kept must have,
    # under the plain forward, the log-probability of the rank it was kept at, to that bound; a
    # token of another rank is off by the gap between ranks.
    if logits.dtype == torch.bfloat16:
        bound = 2 * 2.0 ** (math.floor(math.log2(float(logits.abs().max()))) - 7)
        kept = plain.gather(1, torch.tensor(top["ids"]))
        for what, mine in (("the kept tokens", kept), ("their log-probabilities", torch.tensor(top["logprobs"]))):
            assert float((mine - expected.values).abs().max()) <= bound, what
    else:
        assert top["ids"] == expected.indices.tolist()
        assert_rounding_close(torch.tensor(top["logprobs"]), expected.values, what="top-k log-probabilities")
    manifest = json.loads(check(spds(["prepare", "config.json"], loop_dir)).stdout.splitlines()[-1])
    assert json.loads((loop_dir / "packed-top-k" / "manifest.json").read_text())["top_k"] == 4, manifest


def read_rows_questions(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / "questions.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.over_budget("eval's figures against plain transformers record by record, batched and sharded")
def test_eval_matches_a_hand_computed_reference(tiny):
    edit_config(
        tiny,
        **{**FAST, "optim": {**FAST["optim"], "updates": 2}},
        student={"dtype": "float32"},
        data={"eval_fraction": 0.3},
        context={"text": make_tiny.CONTEXT},
        eval={"kl": True},
    )
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    result = check(spds(["eval", "config.json"], tiny))
    assert "gap recovered" in result.stdout
    report = read_json(tiny / "run" / "eval.json")
    config = load_config(tiny / "config.json")
    store = PackedStore.open(config.packed_dir)
    # the reference: transformers' own model and attention, no spds code between it and the weights
    student = AutoModelForCausalLM.from_pretrained(config.model_path, dtype=torch.float32, attn_implementation="eager")
    prompt = final_state(tiny / "run")["prompt"]
    context = torch.tensor(make_tiny.chatml_tokenizer().encode(make_tiny.CONTEXT, add_special_tokens=False))
    blocks = {"floor": prompt[:0], "soft": prompt, "ceiling": student.get_input_embeddings()(context)}
    per_record = []  # each held-out record's summed NLL under each block, and its summed KL
    held_out = np.flatnonzero(~store.is_train)
    with torch.no_grad():
        for i in held_out:
            ids = torch.from_numpy(store.ids(i))
            prefix, at = int(store.prefix_tokens[i]), int(store.insert_at[i])
            response_logits, nll = {}, {}
            for name, block in blocks.items():
                embeds = student.get_input_embeddings()(ids)
                joined = torch.cat([embeds[:at], block, embeds[at:]])[None]
                labels = torch.cat([ids[:at], torch.full((len(block),), -100), ids[at:]])
                labels[: prefix + len(block)] = -100
                logits = student(inputs_embeds=joined).logits[0]
                nll[name] = float(torch.nn.functional.cross_entropy(logits[:-1], labels[1:], reduction="sum"))
                response_logits[name] = logits[:-1][labels[1:] != -100]
            teacher = torch.log_softmax(response_logits["ceiling"], -1)
            per_record.append(
                (nll, float((teacher.exp() * (teacher - torch.log_softmax(response_logits["soft"], -1))).sum()))
            )

    def expected(records: int) -> dict:  # eval.json's figures over the first `records` held-out records
        tokens = int(store.supervised_tokens[held_out[:records]].sum())
        return dict(
            records=records,
            supervised_tokens=tokens,
            nll={name: sum(nll[name] for nll, _ in per_record[:records]) / tokens for name in blocks},
            kl_to_teacher=sum(kl for _, kl in per_record[:records]) / tokens,
        )

    reference = expected(len(held_out))
    assert report["records"] == len(held_out) and report["supervised_tokens"] == reference["supervised_tokens"]
    # NLL and KL are sums of non-negative terms: their rounding is relative to the sum itself
    for name in blocks:
        assert report["nll"][name] == pytest.approx(reference["nll"][name], rel=ROUNDING), name
    floor, soft, ceiling = (report["nll"][k] for k in ("floor", "soft", "ceiling"))
    assert report["gap_recovered"] == pytest.approx((floor - soft) / (floor - ceiling))  # one formula, in float64
    assert report["context_tokens"] == len(context)
    assert report["kl_to_teacher"] == pytest.approx(reference["kl_to_teacher"], rel=ROUNDING)
    assert report["kl_to_teacher"] > 0
    assert report["teacher"] == "context"
    assert report["tokens_per_second"] > 0 and report["seconds"] > 0
    # Scored in batches (eval.batch_tokens, records of like length together): the same figures to
    # rounding as one record a batch, each phase timed and shown as it goes (stderr is no terminal here)
    assert report["batches"] < report["records"]
    assert set(report["phases"]) == {"scoring held-out records", "greedy answers"}
    assert f"scoring held-out records: {len(held_out)} rows in" in result.stderr
    edit_config(tiny, eval={"kl": True, "batch_tokens": 1})
    check(spds(["eval", "config.json"], tiny))
    alone = read_json(tiny / "run" / "eval.json")
    assert alone["batches"] == alone["records"] == report["records"]
    for name in blocks:
        assert alone["nll"][name] == pytest.approx(report["nll"][name], rel=ROUNDING), name
    assert alone["kl_to_teacher"] == pytest.approx(report["kl_to_teacher"], rel=ROUNDING)
    # a budget whose forward would not fit the device is refused before any record is scored,
    # naming the budget that fits (SPDS_TEST_FREE_BYTES stands in for a GPU's free memory)
    edit_config(tiny, eval={"kl": True, "batch_tokens": 1 << 20})
    (tiny / "run" / "eval.json").unlink()
    refused = spds(["eval", "config.json"], tiny, SPDS_TEST_FREE_BYTES=str(1 << 30))
    assert refused.returncode != 0 and "eval.batch_tokens: a forward over 1048576 positions" in refused.stderr
    assert (
        re.search(r"set eval.batch_tokens to at most \d+", refused.stderr) and not (tiny / "run" / "eval.json").exists()
    )
    edit_config(tiny, eval={"kl": True, "batch_tokens": None})
    # On two ranks with the student sharded as in training, over an odd number of records (one rank
    # runs a filler pass to keep the collective gathers in step): the hand-computed numbers.
    # (Unsharded ranks sharing eval: tests/test_multinode.py, under SLURM, to the one-rank figures.)
    odd = len(held_out) - 1 + len(held_out) % 2
    assert odd % 2 == 1
    edit_config(
        tiny, eval={"kl": True, "max_records": odd}, distributed={"timeout_minutes": 2}
    )  # ranks out of step fail soon instead of hanging
    reference = expected(odd)
    for sharded in (dict(sharding="fsdp"), dict(deepspeed_config="ds_configs/zero3.json")):
        edit_config(tiny, **sharded)
        check(spds(["eval", "config.json"], tiny, world=2, launcher="torchrun"))
        result = read_json(tiny / "run" / "eval.json")
        assert result["records"] == reference["records"]
        for name in blocks:
            assert result["nll"][name] == pytest.approx(reference["nll"][name], rel=ROUNDING), (sharded, name)
        assert result["kl_to_teacher"] == pytest.approx(reference["kl_to_teacher"], rel=ROUNDING)
        edit_config(tiny, sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")


@pytest.mark.slow
def test_export_round_trip_and_generation_splices_as_training(tiny):
    edit_config(tiny, **{**FAST, "optim": {**FAST["optim"], "updates": 2}}, student={"dtype": "float32"})
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    check(spds(["export", "config.json"], tiny))
    prompt, metadata = load_soft_prompt(tiny / "run" / "export" / "soft_prompt.safetensors")
    assert torch.equal(prompt, final_state(tiny / "run")["prompt"]) and prompt.dtype == torch.float32
    assert metadata["placement"] == "system" and metadata["update"] == "2" and int(metadata["prompt_length"]) == 4
    # First-token logits of the generation helper == training-time logits for the same record.
    from spds.model.loss import make_loss
    from spds.model.soft_prompt import Segment, SoftPromptModel

    config = load_config(tiny / "config.json")
    store = PackedStore.open(config.packed_dir)
    student = load_student(config.model_path, "float32", "sdpa", torch.device("cpu"))
    tokenizer = make_tiny.chatml_tokenizer()
    messages = [{"role": "user", "content": "Tell me about the comet."}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ids, insert_at = insertion_point(list(rendered), metadata)
    assert insert_at == len(store.manifest["scaffold"]["system_header"])
    with torch.no_grad():
        generation_logits = student(inputs_embeds=splice(student, prompt, ids, insert_at)).logits[0, -1]
        model = SoftPromptModel(student, prompt, make_loss(section("loss", kernel="chunked", chunk_tokens=64)))
        hidden = model.hidden_states([Segment(torch.tensor(ids), len(ids) - 1, insert_at)], model.prompt)[0]
        training_logits = hidden[-1] @ student.get_output_embeddings().weight.t()
    assert_rounding_close(generation_logits, training_logits, what="logits")
    # What a server takes (vLLM's prompt_embeds, SGLang's input_embeds): training's embeddings, bit for bit.
    from spds.trained.export import generate, prompt_embeds

    served = prompt_embeds(student, tokenizer, prompt, metadata, messages)
    assert served.dtype == student.dtype and served.shape == (len(ids) + len(prompt), student.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(
            served, model.joined_embeddings([Segment(torch.tensor(ids), len(ids), insert_at)], model.prompt)[0]
        )

    reply = generate(student, tokenizer, prompt, metadata, messages, max_new_tokens=5, do_sample=False)
    assert isinstance(reply, str)


@pytest.mark.slow
def test_peft_adapter_gives_the_same_loss_for_prefix_placement(tiny):
    peft = pytest.importorskip("peft")
    edit_config(
        tiny,
        **{
            **FAST,
            "optim": {**FAST["optim"], "updates": 2},
            "soft_prompt": {**FAST["soft_prompt"], "placement": "prefix"},
        },
        student={"dtype": "float32"},
    )
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    exported = json.loads(check(spds(["export", "config.json"], tiny)).stdout.strip().splitlines()[-1])
    config = load_config(tiny / "config.json")
    store = PackedStore.open(config.packed_dir)
    student = load_student(config.model_path, "float32", "sdpa", torch.device("cpu"))
    model = peft.PeftModel.from_pretrained(student, exported["peft_adapter"]).eval()
    prompt = final_state(tiny / "run")["prompt"]
    from spds.model.loss import make_loss
    from spds.model.soft_prompt import Segment, SoftPromptModel

    reference = SoftPromptModel(
        load_student(config.model_path, "float32", "sdpa", torch.device("cpu")),
        prompt,
        make_loss(section("loss", kernel="chunked", chunk_tokens=64)),
    )
    with torch.no_grad():
        for i in range(3):
            ids = torch.from_numpy(store.ids(i))
            labels = ids.clone()
            labels[: int(store.prefix_tokens[i])] = -100
            peft_loss = model(input_ids=ids[None], labels=labels[None]).loss
            spds_loss = reference([Segment(ids, int(store.prefix_tokens[i]), 0)]) / int(store.supervised_tokens[i])
            assert_rounding_close(peft_loss, spds_loss, what=f"record {i}'s loss")


@pytest.mark.slow
def test_sample_answers_three_ways_as_a_plain_greedy_decode_would(tiny):
    """spds sample: the soft prompt's answer is what plain transformers decodes greedily from the
    rendered question with the prompt spliced after the system header by hand; the bare and
    context answers likewise; a rerun writes the same file."""
    from transformers import AutoModelForCausalLM

    edit_config(
        tiny,
        **{**FAST, "optim": {**FAST["optim"], "updates": 2}},
        student={"dtype": "float32"},
        context={"text": make_tiny.CONTEXT},
        eval={"max_new_tokens": 6},
        data={"eval_fraction": 0.3},
    )
    (tiny / "questions.jsonl").write_text(json.dumps({"question_id": "x", "question": "What is the comet?"}) + "\n")
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    shown = check(spds(["sample", "config.json", "--questions", "questions.jsonl", "--n", "1"], tiny)).stdout
    assert "Q: What is the comet?" in shown and "soft" in shown
    rows = [json.loads(line) for line in (tiny / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["question"] == "What is the comet?" and (tiny / "run" / "samples.md").exists()
    tokenizer = make_tiny.chatml_tokenizer()
    plain = AutoModelForCausalLM.from_pretrained(load_config(tiny / "config.json").model_path, dtype=torch.float32)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the comet?"}],
        tokenize=True,
        add_generation_prompt=True,
        return_dict=False,
    )
    header = tokenizer.encode("<|im_start|>system\n", add_special_tokens=False)  # ChatML's, written out
    close = tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    context = tokenizer.encode(make_tiny.CONTEXT, add_special_tokens=False)
    embed = plain.get_input_embeddings()
    inserted = {
        "bare": torch.zeros(0, plain.config.hidden_size),
        "soft": final_state(tiny / "run")["prompt"],
        "context": embed(torch.tensor(context)),
    }
    for view, block in inserted.items():
        with torch.no_grad():
            inputs = torch.cat([embed(torch.tensor(header)), block, embed(torch.tensor(close + list(ids)))])[None]
            output = plain.generate(
                inputs_embeds=inputs,
                attention_mask=torch.ones(inputs.shape[:2], dtype=torch.long),
                max_new_tokens=6,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        assert rows[0][view] == tokenizer.decode(output[0], skip_special_tokens=True).strip(), view
    assert rows[0]["soft"] != rows[0]["bare"]
    before = (tiny / "run" / "samples.jsonl").read_bytes()
    check(spds(["sample", "config.json", "--questions", "questions.jsonl", "--n", "1"], tiny))
    assert (tiny / "run" / "samples.jsonl").read_bytes() == before
    # spds eval reports a few held-out ones beside its figures
    check(spds(["eval", "config.json"], tiny))
    report = read_json(tiny / "run" / "eval.json")
    assert 1 <= len(report["samples"]) <= 3 and all(set(VIEWS) <= set(row) for row in report["samples"])
