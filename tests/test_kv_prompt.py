"""The kv form of the soft prompt (soft_prompt.form kv, spds/model/kv_prompt.py): a learned key and
value at every layer. Its loss and gradient equal a plain transformers computation that holds the
prompt as a past_key_values cache: the header run into a DynamicCache, the prompt's keys and values
appended to it, the rest of the record run after it at positions shifted by p. The reference
imports nothing from spds's model, loss or engine."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_matches_reference
from test_families import FAMILIES, VOCAB, save_family

from spds.contract.gate import section
from spds.model.kv_prompt import kv_shape
from spds.model.loss import final_logit_softcap, make_loss
from spds.model.soft_prompt import Segment, SoftPromptModel
from spds.model.student import load_student

SPDS_FAMILIES = [name for name, family in FAMILIES.items() if family["attn_implementation"] == "sdpa"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-families")
    return {family: save_family(root / family, family) for family in SPDS_FAMILIES}


def cache_reference_loss(plain, prompt: torch.Tensor, segment: Segment) -> torch.Tensor:
    """The summed CE of the record's response tokens with the prompt as a KV cache: x[:a] run
    into a DynamicCache, then the prompt's keys and values ([layers, 2, kv heads, p, D]) appended
    layer by layer, then x[a:] after them at positions a+p .. (transformers counts them from the
    cache's length)."""
    from transformers import DynamicCache

    ids, a, p = segment.ids, segment.insert_at, prompt.shape[3]
    cache = DynamicCache(config=plain.config)
    if a:
        plain(input_ids=ids[:a][None], past_key_values=cache, use_cache=True)
    dtype = plain.get_input_embeddings().weight.dtype
    for layer in range(prompt.shape[0]):
        cache.update(prompt[layer, 0][None].to(dtype), prompt[layer, 1][None].to(dtype), layer)
    rest = ids[a:]
    positions = torch.arange(a + p, a + p + len(rest), device=ids.device)[None]
    logits = plain(input_ids=rest[None], past_key_values=cache, position_ids=positions, use_cache=True).logits[0]
    rows = logits[segment.prefix_tokens - a - 1 : len(rest) - 1].float()
    return torch.nn.functional.cross_entropy(rows, ids[segment.prefix_tokens :], reduction="sum")


@pytest.mark.numeric
@pytest.mark.parametrize("length", [3, 1024])
@pytest.mark.parametrize("family", SPDS_FAMILIES)
def test_kv_prompt_loss_and_gradient_equal_a_plain_past_key_values_forward(saved, family, length):
    """Padded rows and records packed end to end; prompts at the start (prefix) and after a header
    (system, first_user): the keys stored after RoPE at the positions they take. The records run
    over their own tokens alone and read the prompt as a cache: at p = 1,024 (records of 14-31
    tokens) nearly every key a record reads is the prompt's, and the windowed families' windows
    (Gemma's 8) fall inside it."""
    from transformers import AutoModelForCausalLM

    student = load_student(saved[family], "float32", "sdpa", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32).requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    segments = [
        Segment(ids=torch.randint(2, VOCAB, (n,), generator=generator), prefix_tokens=f, insert_at=a)
        for n, f, a in ((23, 9, 2), (14, 5, 0), (31, 20, 3))
    ]
    prompt = torch.randn(*kv_shape(student, length), generator=generator)
    for packed in (False, True):
        loss_fn = make_loss(section("loss", kernel="chunked", chunk_tokens=16), final_logit_softcap(student))
        model = SoftPromptModel(student, prompt.clone(), loss_fn, attention_kernel="math", packed=packed)
        assert model.form == "kv" and model.prompt_length == length and model.inserted_positions == 0
        assert_matches_reference(
            model,
            segments,
            lambda q: sum(cache_reference_loss(plain, q, s) for s in segments),
            prompt,
            what=f"{family} {'packed' if packed else 'padded'}",
        )


@pytest.mark.numeric
@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashAttention's variable-length kernels need CUDA")
@pytest.mark.parametrize("kernel", ["flash", "fa4"])
def test_on_cuda_a_kv_prompt_read_as_a_cache_matches_the_plain_past_key_values_forward_in_bf16(saved, kernel):
    """The GPU's path: a bf16 student, every record's rest against header ++ prompt ++ rest in one
    variable-length FlashAttention call (FA2's, or FA4's where it runs), forward and backward, padded
    and packed, p = 1,024, against the fp32 DynamicCache reference. Tolerances: bf16 keeps 8 bits of
    mantissa, so the summed loss of ~40 tokens agrees to about 1% and the gradient's direction to
    a cosine above 0.99."""
    from transformers import AutoModelForCausalLM

    from spds.kernels.attention import fa4_unavailable

    cuda = torch.device("cuda")
    if kernel == "fa4" and fa4_unavailable(16):
        pytest.skip(f"fa4: {fa4_unavailable(16)}")
    student = load_student(saved["qwen3"], "bfloat16", "sdpa", cuda)
    plain = AutoModelForCausalLM.from_pretrained(saved["qwen3"], dtype=torch.float32).to(cuda).requires_grad_(False)
    generator = torch.Generator().manual_seed(2)
    segments = [
        Segment(ids=torch.randint(2, VOCAB, (n,), generator=generator).to(cuda), prefix_tokens=f, insert_at=a)
        for n, f, a in ((23, 9, 2), (14, 5, 0), (31, 20, 3))
    ]
    prompt = torch.randn(*kv_shape(student, 1024), generator=generator).to(cuda)
    reference = prompt.clone().requires_grad_(True)
    expected = sum(cache_reference_loss(plain, reference, s) for s in segments)
    expected.backward()
    for packed in (False, True):
        loss_fn = make_loss(section("loss", kernel="chunked", chunk_tokens=16), final_logit_softcap(student))
        model = SoftPromptModel(student, prompt.clone(), loss_fn, attention_kernel=kernel, packed=packed, device=cuda)
        loss = model(segments)
        loss.backward()
        cosine = torch.nn.functional.cosine_similarity(model.prompt.grad.flatten(), reference.grad.flatten(), dim=0)
        assert abs(float(loss) - float(expected)) < 0.01 * abs(float(expected)), (packed, float(loss), float(expected))
        assert float(cosine) > 0.99, (packed, float(cosine))


def test_a_kv_prompt_that_pushes_the_longest_record_past_the_window_is_refused_with_the_numbers(tiny):
    """A kv prompt is read as a cache, and its positions still count: a record's rest sits at
    a+p ... Prepare refuses a record p pushes past data.context_limit, naming the row and the sum,
    and writes nothing; validate refuses a prompt that leaves no room for any record."""
    from conftest import edit_config, read_rows

    from spds.contract.gate import load_config
    from spds.data.prepare import prepare
    from spds.errors import SpdsError
    from spds.generation.teacher_window import require_ready

    limit = 512
    longest = max(len(r["input_ids"]) for r in read_rows(tiny / "candidates.jsonl") if "input_ids" in r)
    edit_config(tiny, soft_prompt={"form": "kv", "length": limit - longest + 1}, data={"context_limit": limit})
    with pytest.raises(SpdsError) as caught:
        prepare(load_config(tiny / "config.json"))
    assert "rule 'context limit'" in str(caught.value) and f"soft-prompt tokens = {limit + 1} > " in str(caught.value)
    assert not (tiny / "packed").exists()
    edit_config(tiny, soft_prompt={"form": "kv", "length": limit})
    with pytest.raises(SpdsError) as refused:  # what spds validate runs, in this process
        require_ready(load_config(tiny / "config.json", candidates="generate writes one"))
    named = f"data.context_limit: {limit} positions cannot hold the soft prompt"
    assert any(named in problem for problem in refused.value.problems), refused.value.problems


def test_a_student_on_its_own_attention_cannot_hold_a_kv_prompt(tmp_path):
    """The prompt's keys and values go in through spds's attention: a student kept on eager (or
    any attention spds does not compute) is refused by name, not trained without its prompt."""
    from spds.errors import SpdsError

    student = load_student(save_family(tmp_path / "qwen3", "qwen3"), "float32", "eager", torch.device("cpu"))
    prompt = torch.zeros(*kv_shape(student, 2))
    with pytest.raises(SpdsError, match="form kv puts its keys and values in spds's attention"):
        SoftPromptModel(student, prompt, make_loss(section("loss")))


@pytest.mark.numeric
def test_a_kv_prompt_started_from_the_context_is_the_context_where_the_prompt_goes(tiny_assets):
    """init.method context (Cartridges' initialization): the keys and values the student computes
    for the context's first p tokens after the template's header. A record read with that prompt
    is read exactly as with those p tokens in the prompt's place: same loss, to rounding."""
    from conftest import make_tiny

    from spds.data.chat import derive_scaffold, prompt_header
    from spds.model.student import initial_prompt

    tokenizer = make_tiny.chatml_tokenizer()
    student = load_student(tiny_assets / "student", "float32", "sdpa", torch.device("cpu"))
    header = prompt_header(derive_scaffold(tokenizer, {}, "template", "tiny"), "system", tokenizer, {})
    settings = section("soft_prompt", length=6, form="kv", init={"method": "context"})
    context = tokenizer.encode(make_tiny.CONTEXT, add_special_tokens=False)[:6]
    prompt = initial_prompt(student, settings, 0, tokenizer, context, header)
    assert prompt.shape == kv_shape(student, 6)
    row = next(r for r in make_tiny.synthetic_rows(tokenizer, 4) if "input_ids" in r)
    segment = Segment(ids=torch.tensor(row["input_ids"]), prefix_tokens=row["prefix_tokens"], insert_at=len(header))
    model = SoftPromptModel(student, prompt, make_loss(section("loss", kernel="chunked")), attention_kernel="math")
    with torch.no_grad():
        as_prompt = model([segment])
        as_tokens = model([segment], inserted=student.get_input_embeddings()(torch.tensor(context)))
    # fp32: the prefill and the record compute the same keys in matmuls of other shapes (~1e-7)
    assert torch.allclose(as_prompt, as_tokens, rtol=1e-5), (as_prompt, as_tokens)


@pytest.mark.slow
def test_a_kv_prompt_trains_evaluates_samples_and_exports_a_peft_cartridge_with_the_same_logits(tiny):
    """The whole loop with form kv (prefix placement, started from the context, its first position
    frozen): eval reports the three views; spds sample's soft answer is transformers' own greedy
    decode with the prompt as past_key_values (spds.trained.export.generate); and spds export writes a
    CARTRIDGE adapter by PEFT itself, which PeftModel.from_pretrained loads to the same logits as
    that cache."""
    import json

    from conftest import edit_config, make_tiny
    from helpers import FAST, check, final_state, read_json, spds
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from spds.trained.export import generate, insertion_point, load_soft_prompt, past_key_values

    kv = {"length": 4, "placement": "prefix", "form": "kv", "init": {"method": "context"}, "frozen_positions": 1}
    edit_config(
        tiny,
        **{**FAST, "optim": {**FAST["optim"], "updates": 3}, "soft_prompt": kv},
        student={"dtype": "float32"},
        context={"text": make_tiny.CONTEXT},
        eval={"max_new_tokens": 6, "samples": 1},
        data={"eval_fraction": 0.3},
    )
    (tiny / "questions.jsonl").write_text(json.dumps({"question_id": "x", "question": "What is the comet?"}) + "\n")
    check(spds(["prepare", "config.json"], tiny))
    check(spds(["train", "config.json"], tiny))
    check(spds(["eval", "config.json"], tiny))
    report = read_json(tiny / "run" / "eval.json")
    assert report["gap_recovered"] is not None and set(report["nll"]) == {"floor", "soft", "ceiling"}
    check(spds(["sample", "config.json", "--questions", "questions.jsonl", "--n", "1"], tiny))
    (row,) = [json.loads(line) for line in (tiny / "run" / "samples.jsonl").read_text().splitlines()]
    check(spds(["export", "config.json"], tiny))
    prompt, metadata = load_soft_prompt(tiny / "run" / "export" / "soft_prompt.safetensors")
    assert (
        metadata["form"] == "kv"
        and metadata["insert_at"] == "[0]"
        and torch.equal(prompt, final_state(tiny / "run")["prompt"])
    )
    student_path = json.loads((tiny / "config.json").read_text())["student"]["model_path"]
    plain = AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32).eval()
    tokenizer = make_tiny.chatml_tokenizer()
    messages = [{"role": "user", "content": "What is the comet?"}]
    # fp32: spds's decoder and transformers' generate order a few sums differently (~1e-6), far
    # under the random student's gaps between its top two tokens
    assert (
        row["soft"] == generate(plain, tokenizer, prompt, metadata, messages, max_new_tokens=6, do_sample=False).strip()
    )
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    ids, at = insertion_point(list(ids), metadata)
    cache, input_ids = past_key_values(plain, prompt, ids, at)
    with torch.no_grad():
        expected = plain(input_ids=input_ids[:, at + prompt.shape[3] :], past_key_values=cache).logits
        adapter = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(student_path, dtype=torch.float32), tiny / "run" / "export" / "peft"
        ).eval()
        theirs = adapter(input_ids=torch.tensor([ids])).logits
    assert torch.allclose(theirs, expected, atol=1e-5), (theirs - expected).abs().max()
