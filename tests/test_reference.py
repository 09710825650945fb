"""The update spds applies equals its documented formula, recomputed independently.

The reference below imports nothing from spds: it reads the packed store's two files with numpy,
loads the student with transformers, splices the prompt by hand, takes the cross entropy of the
full logits with torch, and steps torch's AdamW at the learning rate spds logged. It follows the
README's definition of an update:

    batch(u)  = records [k*B, (k+1)*B) of the seeded permutation of epoch e, (e, k) = divmod(u-1, N // B)
    loss      = sum of CE over the batch's supervised tokens / their count
    gradient  = d loss / d prompt, clipped to optim.max_grad_norm, then AdamW

A DeepSpeed default that clipped every gradient to norm 1.0 passed spds's own world-size and
resume tests for months, because both sides shared it; this test is the one that catches it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import edit_config
from helpers import (
    FAST,
    ROUNDING,
    assert_rounding_close,
    assert_same_adam_path,
    check,
    divergence,
    final_state,
    metrics,
    read_json,
    spds,
)

# Gradient norms of about 50, 19 and 13 over the three updates on the tiny example (a small
# prompt is far from anything useful): clipping at 20 changes the first update only. Adam is
# blind to a scale shared by every update, so what shows a wrong clip is a change in the ratio
# between updates: DeepSpeed's default (1.0) would clip all three, to the same norm.
CLIPPED = dict(
    student={"dtype": "float32"},
    soft_prompt={"length": 4, "placement": "system", "init": {"method": "random_normal", "std": 0.002}},
    optim={**FAST["optim"], "updates": 3, "learning_rate": 0.003, "max_grad_norm": 20.0},
)


def reference_run(
    run_dir, learning_rates: list[float], max_grad_norm: float, loss: dict | None = None, on_policy: dict | None = None
) -> dict:
    """`loss` None: CE. Else {objective, direction, temperature, beta, ce_weight, kl_weight, teacher}:
    the teacher is the student with the context's tokens spliced in (a plain forward over the whole
    sequence), or the packed top-k with the rest of the mass one bucket. `on_policy` {update:
    {record: sampled ids}}: those records' answers replaced by the ids (the student's samples,
    as spds logged them in on-policy.jsonl); their greedy continuation under this reference's own
    prompt at that update is returned beside them (`greedy`), for a test at near-zero temperature."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((run_dir / "config.json").read_text())
    optim, init = config["optim"], config["soft_prompt"]["init"]
    packed = run_dir / config["data"]["packed_dir"]
    index = [json.loads(line) for line in (packed / "index.jsonl").read_text().splitlines()]
    tokens = np.fromfile(packed / "tokens.uint32", dtype="<u4").astype(np.int64)
    train = [entry for entry in index if entry["split"] == "train"]
    student = AutoModelForCausalLM.from_pretrained(config["student"]["model_path"], dtype=torch.float32)
    student.requires_grad_(False).eval()
    embed = student.get_input_embeddings()
    length, hidden = config["soft_prompt"]["length"], student.config.hidden_size
    kv = config["soft_prompt"].get("form") == "kv"  # keys and values of every layer, after RoPE
    c = student.config
    head_dim = getattr(c, "head_dim", None) or hidden // c.num_attention_heads
    shape = (c.num_hidden_layers, 2, c.num_key_value_heads, length, head_dim) if kv else (length, hidden)
    prompt = torch.randn(*shape, generator=torch.Generator().manual_seed(optim["seed"])) * init["std"]
    prompt.requires_grad_(True)
    frozen = config["soft_prompt"].get("frozen_positions", 0)
    adam = torch.optim.AdamW(
        [prompt],
        lr=learning_rates[0],
        betas=tuple(optim.get("betas", (0.9, 0.999))),
        eps=optim.get("eps", 1e-8),
        weight_decay=optim.get("weight_decay", 0.0),
    )
    if loss is not None and loss["teacher"] == "context":
        tokenizer = AutoTokenizer.from_pretrained(config["student"]["model_path"])
        context = embed(torch.tensor(tokenizer.encode(config["context"]["text"], add_special_tokens=False)))
    if loss is not None and loss["teacher"] == "top_k":
        k = json.loads((packed / "manifest.json").read_text())["top_k"]
        top_ids = torch.from_numpy(np.fromfile(packed / "top_k_ids.int32", dtype="<i4").astype(np.int64)).view(-1, k)
        top_logprobs = torch.from_numpy(np.fromfile(packed / "top_k_logprobs.float32", dtype="<f4")).view(-1, k)
    B, grad_norms, greedy = optim["effective_batch"], [], {}
    for update, learning_rate in enumerate(learning_rates, start=1):
        epoch, k = divmod(update - 1, len(train) // B)
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([optim["seed"], epoch])))
        order = generator.permutation(len(train))
        batch = [train[i] for i in order[k * B : (k + 1) * B]]
        total, supervised = torch.zeros(()), 0
        sampled = (on_policy or {}).get(update, {})
        for entry in batch:
            ids = torch.from_numpy(tokens[entry["offset"] : entry["offset"] + entry["length"]])
            a, prefix = entry["insert_at"], entry["prefix_tokens"]
            record = index.index(entry)
            if record in sampled:
                answer = torch.tensor(sampled[record])
                greedy[update, record] = greedy_answer(student, embed, prompt, ids[:a], ids[a:prefix], len(answer))
                ids = torch.cat([ids[:prefix], answer])
            supervised += len(ids) - prefix
            if kv:
                response_logits = cached_prompt_logits(student, prompt, ids, a)[prefix - a - 1 : len(ids) - a - 1]
            else:
                joined = torch.cat([embed(ids[:a]), prompt, embed(ids[a:])])[None]
                logits = student(inputs_embeds=joined).logits[0].float()
                # response token ids[t] sits at joined position t + length and is predicted from the one before
                response_logits = logits[prefix + length - 1 : len(ids) + length - 1]
            ce = torch.nn.functional.cross_entropy(response_logits, ids[prefix:], reduction="sum")
            if loss is None:
                total = total + ce
                continue
            T = loss["temperature"]
            log_q = torch.log_softmax(response_logits / T, dim=-1)
            if loss["teacher"] == "context":
                with torch.no_grad():
                    seen = torch.cat([embed(ids[:a]), context, embed(ids[a:])])[None]
                    C = len(context)
                    teacher = student(inputs_embeds=seen).logits[0, prefix + C - 1 : len(ids) + C - 1]
                log_p = torch.log_softmax(teacher / T, dim=-1)
            else:
                rows = slice(entry["top_k_offset"], entry["top_k_offset"] + entry["supervised_tokens"])
                chosen, logprobs = top_ids[rows], top_logprobs[rows]
                q_top = log_q.exp().gather(1, chosen)
                log_q = torch.cat([q_top, 1 - q_top.sum(-1, keepdim=True)], dim=1).log()
                log_p = torch.cat([logprobs, (1 - logprobs.exp().sum(-1, keepdim=True)).log()], dim=1)
            kl = divergence(log_p, log_q, loss["direction"], loss["beta"])
            total = total + loss["ce_weight"] * ce + loss["kl_weight"] * kl
        (total / supervised).backward()
        if frozen:  # the first positions keep their start: no gradient
            (prompt.grad[..., :frozen, :] if kv else prompt.grad[:frozen]).zero_()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_([prompt], max_grad_norm)))
        for group in adam.param_groups:
            group["lr"] = learning_rate
        adam.step()
        adam.zero_grad()
    state = adam.state[prompt]
    return dict(
        prompt=prompt.detach(),
        exp_avg=state["exp_avg"],
        exp_avg_sq=state["exp_avg_sq"],
        grad_norms=grad_norms,
        greedy=greedy,
    )


def cached_prompt_logits(student, prompt, ids, a: int) -> torch.Tensor:
    """A kv prompt ([layers, 2, kv heads, p, D]) as transformers' own past_key_values: ids[:a] run
    into a DynamicCache, the prompt's keys and values appended layer by layer, ids[a:] run after
    them (at positions a + p on, counted from the cache); the logits of ids[a:], fp32."""
    import inspect

    from transformers import DynamicCache

    keyword = "cache" if "cache" in inspect.signature(student.forward).parameters else "past_key_values"
    cache = DynamicCache(config=student.config)
    if a:
        student(input_ids=ids[:a][None], use_cache=True, **{keyword: cache})
    for layer in range(prompt.shape[0]):
        cache.update(prompt[layer, 0][None], prompt[layer, 1][None], layer)
    return student(input_ids=ids[a:][None], use_cache=True, **{keyword: cache}).logits[0].float()


@torch.no_grad()
def greedy_answer(student, embed, prompt, header, question, steps: int) -> list[int]:
    """`steps` greedy tokens of the student after header ++ prompt ++ question, by full forwards."""
    joined = torch.cat([embed(header), prompt.detach(), embed(question)])
    picked = []
    for _ in range(steps):
        token = int(student(inputs_embeds=joined[None]).logits[0, -1].argmax())
        picked.append(token)
        joined = torch.cat([joined, embed(torch.tensor([token]))])
    return picked


def assert_same_state(state: dict, reference: dict, learning_rates: list[float], name: str) -> None:
    """spds's prompt and Adam moments against the plain-PyTorch reference's, their gradients
    equal up to rounding: the prompt along the same Adam path; m a weighted sum of the gradients
    (their relative rounding); v of their squares (twice it)."""
    assert_same_adam_path(state["prompt"], reference["prompt"], learning_rates, what=f"{name} prompt")
    assert_rounding_close(state["exp_avg"], reference["exp_avg"], what=f"{name} exp_avg")
    assert_rounding_close(state["exp_avg_sq"], reference["exp_avg_sq"], 2 * ROUNDING, what=f"{name} exp_avg_sq")


RUNS = {  # name: (world, launcher, extra config)
    "zero0-1": (1, "plain", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")),
    "zero0-3": (3, "torchrun", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")),
    "zero3-2": (2, "torchrun", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero3.json")),
    "fsdp-2": (2, "torchrun", dict(sharding="fsdp", deepspeed_config="ds_configs/zero0.json")),
    # up to three records end to end in one forward, each attending only to itself
    "packed-2": (
        2,
        "torchrun",
        dict(
            sharding="deepspeed",
            deepspeed_config="ds_configs/zero0.json",
            optim={**CLIPPED["optim"], "micro_batch": 3, "micro_batch_layout": "packed"},
        ),
    ),
}


def train_each(prepared, runs: dict, settings: dict) -> tuple[dict, dict]:
    """Each run of `runs` (name: world, launcher, extra config) trained with `settings`: its final
    state and its metrics lines, by name."""
    states, lines = {}, {}
    for name, (world, launcher, extra) in runs.items():
        edit_config(prepared, output_dir=name, **{**settings, **extra})
        check(spds(["train", "config.json"], prepared, world=world, launcher=launcher))
        assert read_json(prepared / name / "run.json")["world_size"] == world
        states[name], lines[name] = final_state(prepared / name), metrics(prepared / name)
    return states, lines


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.over_budget(
    "the update against plain PyTorch on every backend and world size: the product's first promise"
)
def test_update_equals_plain_pytorch_for_every_backend_and_world_size(prepared):
    states, lines = train_each(prepared, RUNS, CLIPPED)
    for name, (world, _, _) in RUNS.items():
        for line in lines[name]:  # every rank's compute before the all-reduce (rank 0's within its update)
            busy = line["rank_busy_seconds"]
            assert len(busy) == world and 0 < min(busy) and busy[0] <= line["seconds"], (name, busy)
    learning_rates = [line["learning_rate"] for line in lines["zero0-1"]]
    reference = reference_run(prepared, learning_rates, max_grad_norm=20.0)
    norms = reference["grad_norms"]
    assert norms[0] > 20 > max(norms[1:]) > 1, f"gradient norms {norms} no longer straddle the clips"
    for name, state in states.items():
        assert_same_state(state, reference, learning_rates, name)
        # the logged norm is the one before clipping, of the gradient that was applied
        assert [m["grad_norm"] for m in lines[name]] == pytest.approx(reference["grad_norms"], rel=ROUNDING)
        assert [m["learning_rate"] for m in lines[name]] == learning_rates
        assert_same_adam_path(state["prompt"], states["zero0-1"]["prompt"], learning_rates, what=f"{name} vs zero0-1")
    # What the test guards against: a second clip at 1.0 (DeepSpeed's default), or no clip at all,
    # moves the prompt far beyond the tolerance above.
    for other in (1.0, float("inf")):
        assert (reference_run(prepared, learning_rates, other)["prompt"] - reference["prompt"]).abs().max() > 1e-4


# Every direction, on 1, 2 and 3 ranks between them; the kernel itself is checked for every
# direction and temperature against the same formulas in tests/test_kl.py.
KL_RUNS = {  # name: (world, launcher, loss section, reference's loss)
    "kl-forward-1": (
        1,
        "plain",
        dict(objective="kl", reuse_context_kv=False),  # the batched teacher; the others the default, cached
        dict(direction="forward", temperature=1.0, ce_weight=0.0, kl_weight=1.0),
    ),
    "kl-reverse-2": (
        2,
        "torchrun",
        dict(objective="kl", kl={"direction": "reverse", "temperature": 2.0}),
        dict(direction="reverse", temperature=2.0, ce_weight=0.0, kl_weight=1.0),
    ),
    "mix-jsd-3": (
        3,
        "torchrun",
        dict(
            objective="mix",
            ce_weight=0.5,
            kl_weight=2.0,
            teacher_memo_gib=0.01,
            kl={"direction": "jsd", "jsd_beta": 0.3, "temperature": 1.5},
        ),
        dict(direction="jsd", temperature=1.5, ce_weight=0.5, kl_weight=2.0, beta=0.3),
    ),
}


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.over_budget("the online teacher's update against plain PyTorch on 1, 2 and 3 ranks")
def test_kl_update_equals_plain_pytorch_online_teacher_on_1_2_and_3_ranks(prepared):
    from conftest import make_tiny

    for name, (world, launcher, section, expected) in KL_RUNS.items():
        edit_config(prepared, output_dir=name, **CLIPPED, loss=section, context={"text": make_tiny.CONTEXT})
        check(spds(["train", "config.json"], prepared, world=world, launcher=launcher))
        assert read_json(prepared / name / "run.json")["loss_kernel"] == "chunked-distillation"
        lines = metrics(prepared / name)
        reference = reference_run(
            prepared,
            [m["learning_rate"] for m in lines],
            max_grad_norm=20.0,
            loss=dict(dict(beta=0.5, teacher="context"), **expected),
        )
        state = final_state(prepared / name)
        assert_same_state(state, reference, [m["learning_rate"] for m in lines], name)
        assert [m["grad_norm"] for m in lines] == pytest.approx(reference["grad_norms"], rel=ROUNDING)
        assert (
            state["prompt"] - reference_run(prepared, [m["learning_rate"] for m in lines], 20.0)["prompt"]
        ).abs().max() > 1e-4, f"{name}: the KL run moved the prompt as CE would"


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.numeric
def test_on_policy_update_equals_plain_pytorch_on_1_2_and_3_ranks(prepared):
    """loss.on_policy: half of each batch answered by the student with the prompt of that update,
    at a temperature (1e-4) that makes sampling greedy unless two logits lie within about 1e-3:
    the reference decodes those answers itself with full forwards under its own prompt and gets
    the same ids, then takes the same update from them. The samples are the same whatever the
    world size (every rank samples them all, in one batch)."""
    from conftest import make_tiny

    on_policy = dict(fraction=0.5, temperature=1e-4, max_new_tokens=6)
    logged = {}
    runs = (("on-policy-1", 1, "plain"), ("on-policy-2", 2, "torchrun"), ("on-policy-3", 3, "torchrun"))
    for name, world, launcher in runs:
        edit_config(
            prepared,
            output_dir=name,
            **CLIPPED,
            loss=dict(objective="kl", teacher="context", on_policy=on_policy),
            context={"text": make_tiny.CONTEXT},
        )
        check(spds(["train", "config.json"], prepared, world=world, launcher=launcher))
        lines = metrics(prepared / name)
        logged[name] = (prepared / name / "on-policy.jsonl").read_text()
        samples = {
            line["update"]: {s["record"]: s["ids"] for s in line["samples"]}
            for line in map(json.loads, logged[name].splitlines())
        }
        assert [len(samples[u]) for u in (1, 2, 3)] == [3, 3, 3]  # half of 6 rows
        rates = [m["learning_rate"] for m in lines]
        reference = reference_run(
            prepared,
            rates,
            max_grad_norm=20.0,
            loss=dict(teacher="context", direction="forward", temperature=1.0, beta=0.5, ce_weight=0.0, kl_weight=1.0),
            on_policy=samples,
        )
        for (update, record), greedy in reference["greedy"].items():
            ids = samples[update][record]
            cut = len(ids) > on_policy["max_new_tokens"]  # closed by spds's end token, never picked
            assert greedy[: len(ids) - cut] == ids[: len(ids) - cut], (name, update, record)
        for line, update in zip(lines, (1, 2, 3)):
            assert line["on_policy"]["sampled_tokens"] == sum(len(ids) for ids in samples[update].values())
        state = final_state(prepared / name)
        assert_same_state(state, reference, rates, name)
        assert [m["grad_norm"] for m in lines] == pytest.approx(reference["grad_norms"], rel=ROUNDING)
    assert logged["on-policy-1"] == logged["on-policy-2"] == logged["on-policy-3"]


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.over_budget("the offline teacher's KL against plain PyTorch: no other test computes it independently")
def test_kl_over_an_offline_teachers_top_k_equals_plain_pytorch_on_that_support(prepared):
    """Rows carrying top-k log-probabilities (random here: the arithmetic is the point) are packed
    beside the tokens and trained on; the reference reads the packed files with numpy."""
    index = [json.loads(line) for line in (prepared / "packed" / "index.jsonl").read_text().splitlines()]
    supervised = {entry["request_id"]: entry["supervised_tokens"] for entry in index}
    generator = np.random.default_rng(0)
    rows = []
    for line in (prepared / "candidates.jsonl").read_text().splitlines():
        row = json.loads(line)
        n, k = supervised[row["request_id"]], 5
        ids = [generator.choice(200, size=k, replace=False).tolist() for _ in range(n)]
        shares = generator.dirichlet(np.ones(k), size=n) * generator.uniform(0.5, 0.95, size=(n, 1))
        rows.append(dict(row, top_logprobs=dict(ids=ids, logprobs=np.log(shares).tolist())))
    (prepared / "top-k.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    edit_config(
        prepared,
        output_dir="top-k",
        **CLIPPED,
        loss=dict(objective="kl", teacher="top_k"),
        data={"candidates": [{"path": "top-k.jsonl"}], "packed_dir": "packed-top-k"},
    )
    check(spds(["prepare", "config.json"], prepared))
    check(spds(["train", "config.json"], prepared, world=2, launcher="torchrun"))
    lines = metrics(prepared / "top-k")
    reference = reference_run(
        prepared,
        [m["learning_rate"] for m in lines],
        max_grad_norm=20.0,
        loss=dict(direction="forward", temperature=1.0, ce_weight=0.0, kl_weight=1.0, beta=0.5, teacher="top_k"),
    )
    assert_same_state(final_state(prepared / "top-k"), reference, [m["learning_rate"] for m in lines], "top-k")
    # A row without them under an offline teacher is refused, naming file, line, request_id and rule.
    (prepared / "top-k.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows[:3])
        + json.dumps({k: v for k, v in rows[3].items() if k != "top_logprobs"})
        + "\n"
    )
    edit_config(prepared, data={"candidates": [{"path": "top-k.jsonl"}], "packed_dir": "packed-top-k-2"})
    result = spds(["prepare", "config.json"], prepared)
    assert result.returncode != 0
    assert f"top-k.jsonl:4: request_id {rows[3]['request_id']}: rule 'top-k for an offline teacher'" in result.stderr


# The kv form (soft_prompt.form kv): every layer's keys and values at the prompt's positions are
# the parameter; the reference holds them as transformers' own past_key_values.
KV = dict(soft_prompt={**CLIPPED["soft_prompt"], "form": "kv", "frozen_positions": 1, "init": {"std": 0.2}})
# the backends' runs above, and the packed layout on three ranks
KV_RUNS = {f"kv-{name}": RUNS[name] for name in ("zero0-1", "fsdp-2", "zero3-2")}
KV_RUNS["kv-packed-3"] = (3, "torchrun", RUNS["packed-2"][2])


@pytest.mark.slow
@pytest.mark.numeric
@pytest.mark.over_budget("the kv prompt's update against a plain past_key_values forward on 1, 2 and 3 ranks")
def test_kv_update_equals_plain_pytorch_past_key_values_on_1_2_and_3_ranks(prepared):
    """The kv prompt's update, padded on one rank, sharded on two (FSDP2, ZeRO-3) and packed on
    three, against the reference holding the prompt as a DynamicCache; its first position frozen."""
    states, lines = train_each(prepared, KV_RUNS, {**CLIPPED, **KV})
    lines = lines["kv-zero0-1"]
    learning_rates = [line["learning_rate"] for line in lines]
    reference = reference_run(prepared, learning_rates, max_grad_norm=20.0)
    start = torch.randn(*reference["prompt"].shape, generator=torch.Generator().manual_seed(5)) * 0.2
    assert torch.equal(reference["prompt"][..., 0, :], start[..., 0, :])  # the frozen position kept its start
    for name, state in states.items():
        assert_same_state(state, reference, learning_rates, name)
        assert torch.equal(state["prompt"][..., 0, :], start[..., 0, :]), name
    assert [m["grad_norm"] for m in lines] == pytest.approx(reference["grad_norms"], rel=ROUNDING)
