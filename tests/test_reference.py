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
from helpers import FAST, check, final_state, metrics, read_json, spds

# Gradient norms of about 50, 19 and 13 over the three updates on the tiny example (a small
# prompt is far from anything useful): clipping at 20 changes the first update only. Adam is
# blind to a scale shared by every update, so what shows a wrong clip is a change in the ratio
# between updates: DeepSpeed's default (1.0) would clip all three, to the same norm.
CLIPPED = dict(student={"dtype": "float32"},
               soft_prompt={"length": 4, "placement": "system", "init": {"method": "random_normal", "std": 0.002}},
               optim={**FAST["optim"], "updates": 3, "learning_rate": 0.003, "max_grad_norm": 20.0})


def reference_run(run_dir, learning_rates: list[float], max_grad_norm: float) -> dict:
    from transformers import AutoModelForCausalLM

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
    prompt = (torch.randn(length, hidden, generator=torch.Generator().manual_seed(optim["seed"])) * init["std"])
    prompt.requires_grad_(True)
    adam = torch.optim.AdamW([prompt], lr=learning_rates[0], betas=tuple(optim.get("betas", (0.9, 0.999))),
                             eps=optim.get("eps", 1e-8), weight_decay=optim.get("weight_decay", 0.0))
    B, grad_norms = optim["effective_batch"], []
    for update, learning_rate in enumerate(learning_rates, start=1):
        epoch, k = divmod(update - 1, len(train) // B)
        generator = np.random.Generator(np.random.PCG64(np.random.SeedSequence([optim["seed"], epoch])))
        order = generator.permutation(len(train))
        batch = [train[i] for i in order[k * B:(k + 1) * B]]
        total = torch.zeros(())
        for entry in batch:
            ids = torch.from_numpy(tokens[entry["offset"]:entry["offset"] + entry["length"]])
            a, prefix = entry["insert_at"], entry["prefix_tokens"]
            joined = torch.cat([embed(ids[:a]), prompt, embed(ids[a:])])[None]
            logits = student(inputs_embeds=joined).logits[0].float()
            # response token ids[t] sits at joined position t + length and is predicted from the one before
            total = total + torch.nn.functional.cross_entropy(logits[prefix + length - 1:len(ids) + length - 1],
                                                              ids[prefix:], reduction="sum")
        (total / sum(entry["supervised_tokens"] for entry in batch)).backward()
        grad_norms.append(float(torch.nn.utils.clip_grad_norm_([prompt], max_grad_norm)))
        for group in adam.param_groups:
            group["lr"] = learning_rate
        adam.step()
        adam.zero_grad()
    state = adam.state[prompt]
    return dict(prompt=prompt.detach(), exp_avg=state["exp_avg"], exp_avg_sq=state["exp_avg_sq"], grad_norms=grad_norms)


RUNS = {  # name: (world, launcher, extra config)
    "zero0-1": (1, "plain", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")),
    "zero0-3": (3, "torchrun", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero0.json")),
    "zero3-2": (2, "torchrun", dict(sharding="deepspeed", deepspeed_config="ds_configs/zero3.json")),
    "fsdp-2": (2, "torchrun", dict(sharding="fsdp", deepspeed_config="ds_configs/zero0.json")),
}


@pytest.mark.slow
def test_update_equals_plain_pytorch_for_every_backend_and_world_size(prepared):
    states, lines = {}, {}
    for name, (world, launcher, extra) in RUNS.items():
        edit_config(prepared, output_dir=name, **CLIPPED, **extra)
        check(spds(["train", "config.json"], prepared, world=world, launcher=launcher))
        assert read_json(prepared / name / "run.json")["world_size"] == world
        states[name], lines[name] = final_state(prepared / name), metrics(prepared / name)
    learning_rates = [line["learning_rate"] for line in lines["zero0-1"]]
    reference = reference_run(prepared, learning_rates, max_grad_norm=20.0)
    norms = reference["grad_norms"]
    assert norms[0] > 20 > max(norms[1:]) > 1, f"gradient norms {norms} no longer straddle the clips"
    for name, state in states.items():
        for key in ("prompt", "exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(state[key], reference[key], rtol=0, atol=1e-6,
                                       msg=lambda m, name=name, key=key: f"{name} {key} vs plain PyTorch: {m}")
        # the logged norm is the one before clipping, of the gradient that was applied
        assert [m["grad_norm"] for m in lines[name]] == pytest.approx(reference["grad_norms"], rel=1e-5)
        assert [m["learning_rate"] for m in lines[name]] == learning_rates
        torch.testing.assert_close(state["prompt"], states["zero0-1"]["prompt"], rtol=0, atol=1e-6)
    # What the test guards against: a second clip at 1.0 (DeepSpeed's default), or no clip at all,
    # moves the prompt far beyond the tolerance above.
    for other in (1.0, float("inf")):
        assert (reference_run(prepared, learning_rates, other)["prompt"] - reference["prompt"]).abs().max() > 1e-4
