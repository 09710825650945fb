"""spds generate's decoding (spds/generation/decode.py) against transformers' own `generate`, the path it
replaced: for greedy decoding the answers are the same ids, for every decoder family
(tests/fixtures/models/families.json), with prompts that share a long prefix and questions of
different lengths; the shared prefix is computed once for every batch that shares it; and a
sampled batch is the same on a second run with the same seed."""

from __future__ import annotations

import pytest
import torch
from test_families import FAMILIES, save_family
from transformers import AutoModelForCausalLM

from spds.errors import SpdsError
from spds.generation.decode import Decoder, common_prefix, pick
from spds.generation.generate import load_teacher

END = 1


def prompts(generator: torch.Generator, context: int = 40, vocab: int = 300) -> list[list[int]]:
    """A shared 'template + context' prefix, then questions of 1 to 9 tokens."""
    shared = torch.randint(2, vocab, (context,), generator=generator).tolist()
    return [shared + torch.randint(2, vocab, (n,), generator=generator).tolist() for n in (5, 1, 9, 3)]


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' generate, one prompt at a time (no padding at all): the answer up to and
    including its first end token, or closed with one when cut."""
    ids = torch.tensor([prompt])
    output = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=[END],
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    end = next((i for i, t in enumerate(output) if t == END), None)
    return output[: end + 1] if end is not None else output + [END]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode-families")
    return {family: save_family(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_answers_equal_transformers_generate(saved, family):
    model = load_teacher(saved[family], "float32", torch.device("cpu"))
    plain = load_teacher(saved[family], "float32", torch.device("cpu"))  # transformers' own attention
    batch = prompts(torch.Generator().manual_seed(4))
    decoder = Decoder(model, [END], pad_id=0)
    answers = decoder.answer(batch, max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0)
    # fp32 on the CPU: the split into prefix and question changes the order of a few sums (rounding
    # at 1e-7 of the logits), far under the gaps between a random model's top two logits here
    assert answers == [reference_greedy(plain, p, 12) for p in batch], family
    assert decoder.prefix_forwards == 1
    again = decoder.answer(batch[:2], max_new_tokens=12, temperature=0.0, top_p=1.0, seed=0)
    assert again == answers[:2] and decoder.prefix_forwards == 1  # the same prefix: its keys and values kept


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_steps_logits_equal_transformers_forward(saved, family, monkeypatch):
    """The logits the decoder picks each token from, at every step, against transformers' own
    forward over the whole prompt and answer so far (no cache, its own masks and windows): the
    shared prefix read once and merged with each row's own keys, the windows cut across both
    parts (the tiny Gemmas' windows of 8 end inside the shared 40 tokens), the holes and
    positions of right-aligned questions."""
    import spds.generation.decode

    model = load_teacher(saved[family], "float32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32, attn_implementation="eager")
    seen = []
    original = spds.generation.decode.pick
    monkeypatch.setattr(
        spds.generation.decode, "pick", lambda logits, *a: seen.append(logits.clone()) or original(logits, *a)
    )
    batch = prompts(torch.Generator().manual_seed(4))
    answers = Decoder(model, [END], pad_id=0).answer(batch, 12, temperature=0.0, top_p=1.0, seed=0)
    worst = 0.0
    for row, (prompt, answer) in enumerate(zip(batch, answers)):
        picked = answer[: len(seen)]  # a cut answer's closing end token was never picked
        with torch.no_grad():
            reference = plain(torch.tensor([prompt + picked[:-1]])).logits[0, len(prompt) - 1 :]
        for step in range(len(picked)):
            worst = max(worst, (seen[step][row] - reference[step]).abs().max().item())
    # fp32: the two-part softmax and another order of sums move logits by ~1e-6; a key missed or
    # seen wrongly moves them by ~1e-2 and more
    assert worst < 1e-4, (family, worst)


def assert_top_k_of_plain_forward(plain, batch, answers, tops, family):
    """Each answer's kept top-4 against transformers' forward over its whole prompt and answer."""
    for prompt, answer, top in zip(batch, answers, tops):
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits, dim=-1).topk(4, dim=-1)
        assert top["ids"] == expected.indices.tolist(), family
        # fp32: the two-part softmax and another order of sums (~1e-6, as above)
        assert (torch.tensor(top["logprobs"]) - expected.values).abs().max() < 1e-4, family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_top_k_taken_while_decoding_equals_transformers_forward(saved, family):
    """generate.top_k_logprobs comes from the decode step's own logits: at every answer token (a cut
    answer's appended end token included, which takes one more step), the k most likely next
    tokens and their log-probabilities at temperature 1, whatever the sampling temperature, equal
    a plain forward's over the whole prompt and answer."""
    model = load_teacher(saved[family], "float32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32, attn_implementation="eager")
    batch = prompts(torch.Generator().manual_seed(7))
    answers, tops = Decoder(model, [END], pad_id=0).answer_with_top_k(batch, 6, 0.7, 1.0, seed=3, k=4)
    assert any(END not in answer[:-1] and len(answer) == 7 for answer in answers)  # a cut answer, closed
    assert_top_k_of_plain_forward(plain, batch, answers, tops, family)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_top_k_of_given_answers_equals_transformers_forward(saved, family):
    """Decoder.score (a recital's answer is given, not sampled): at every token of each given
    answer, the top-k equal a plain forward's over the prompt and answer; copies of one request
    (samples_per_question) share their whole answer, yet each is scored after its prompt; the
    prefix kept by an earlier answer is read, not run again."""
    model = load_teacher(saved[family], "float32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(saved[family], dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(11)
    batch = prompts(generator)
    answers = [torch.randint(2, 300, (n,), generator=generator).tolist() + [END] for n in (7, 2, 11, 4)]
    batch, answers = batch + batch[:1], answers + answers[:1]  # a copy of the first request
    decoder = Decoder(model, [END], pad_id=0)
    decoder.answer([p + [5, 6] for p in batch], 2, 0.0, 1.0, seed=0)  # keeps the prefix score needs
    tops = decoder.score(batch, answers, k=4)
    assert decoder.prefix_forwards == 1
    assert_top_k_of_plain_forward(plain, batch, answers, tops, family)
    assert tops[-1]["ids"] == tops[0]["ids"]  # the copy: its own row, the same top-k (values to rounding)
    copies = decoder.score(batch[:1] * 2, answers[:1] * 2, k=4)  # all the batch's prompts and answers alike
    assert [top["ids"] for top in copies] == [tops[0]["ids"]] * 2


def test_rows_hold_only_their_own_positions_and_read_the_prefix_in_place(saved, monkeypatch):
    """What lets a batch hold a thousand rows under a long context: each row's cache is its
    question and answer only, and every batch reads the prefix's one copy."""
    import spds.generation.decode

    made = []

    class Spied(spds.generation.decode.BatchCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(spds.generation.decode, "BatchCache", Spied)
    decoder = Decoder(load_teacher(saved["qwen3"], "float32", torch.device("cpu")), [END], 0)
    batch = prompts(torch.Generator().manual_seed(3))  # a 40-token prefix, questions of up to 9
    decoder.answer(batch, 12, temperature=0.0, top_p=1.0, seed=0)
    decoder.answer(batch[1:], 12, temperature=0.0, top_p=1.0, seed=0)
    prefix_run, first, second = made
    assert [k.shape[:2] for k in first.keys] == [(4, 32)] * 2  # 9 + 12 positions, in rows of 16
    assert [k.shape[:2] for k in second.keys] == [(3, 32)] * 2
    (kept,) = decoder.kept.values()
    held = [k.data_ptr() for k, _ in kept]
    assert [k.data_ptr() for k, _ in first.shared] == held == [k.data_ptr() for k, _ in second.shared]
    assert [k.shape[2] for k, _ in first.shared] == [40, 40] and prefix_run.rows == 1


def test_a_prefix_is_run_by_its_own_forward_and_shared_only_within_the_bound(saved):
    """The numbers of a shared prefix must not depend on what ran before it (a rank of a
    multi-rank generate runs other batches before batch k than one rank does): a prefix is never
    cut from a longer one kept, and `shared_within` fixes it for batches whose own common
    prefixes differ, so they share one."""
    decoder = Decoder(load_teacher(saved["qwen3"], "float32", torch.device("cpu")), [END], 0)
    batch = prompts(torch.Generator().manual_seed(3))  # a 40-token prefix, then questions
    decoder.answer(batch, 4, temperature=0.0, top_p=1.0, seed=0)
    decoder.answer([p[:30] + p[-1:] for p in batch], 4, temperature=0.0, top_p=1.0, seed=0)
    assert decoder.prefix_forwards == 2 and sorted(len(k) for k in decoder.kept) == [30, 40]  # not cut from 40
    bound = Decoder(load_teacher(saved["qwen3"], "float32", torch.device("cpu")), [END], 0)
    longer = [batch[0][:40] + [7, 8] + p[40:] for p in batch]  # a batch whose questions share two more tokens
    for asked in (batch, longer):
        bound.answer(asked, 4, temperature=0.0, top_p=1.0, seed=0, shared_within=40)
    assert bound.prefix_forwards == 1 and [len(k) for k in bound.kept] == [40]


def test_a_batch_too_large_for_the_gpu_is_refused_before_it_starts(saved, monkeypatch):
    """A batch whose keys, values and logits would not fit is refused with what fits, before any
    allocation, not by an out-of-memory error halfway through."""
    import spds.generation.decode

    decoder = Decoder(load_teacher(saved["qwen3"], "float32", torch.device("cpu")), [END], 0)
    batch = prompts(torch.Generator().manual_seed(3))
    decoder.answer(batch, 1, temperature=0.0, top_p=1.0, seed=0)  # the shared prefix, kept, before memory is short
    # the tiny Qwen3: 2 layers x 2 (keys, values) x 1 kv head x 16 dims x 4 bytes = 256 bytes a
    # position, 32 positions (9 + 12, in rows of 16) = 8 KiB a row, 3 x 4 x 300 vocabulary bytes,
    # and the prefill's activations over the row's own 9 positions: 4 x 9 x 256 (the MLP's width) x 4
    per_row = 32 * 256 + 3 * 4 * 300 + 4 * 9 * 256 * 4
    monkeypatch.setattr(
        spds.generation.decode, "free_bytes", lambda device: int(per_row * 3 / 0.9) + 16
    )  # room for 3 rows
    with pytest.raises(SpdsError, match=r"generate.batch_size: 4 rows .* set generate.batch_size to at most 3"):
        decoder.answer(batch, 12, temperature=0.0, top_p=1.0, seed=0)
    assert len(decoder.answer(batch[:3], 12, temperature=0.0, top_p=1.0, seed=0)) == 3
    # generate.top_k_logprobs keeps k int32 ids and fp32 log-probabilities a step (13 with the
    # closing one): at k 64, 6.5 KiB more a row, so the same room holds 2 rows
    with pytest.raises(SpdsError, match=r"generate.batch_size: 3 rows .* at most 2"):
        decoder.answer_with_top_k(batch[:3], 12, 0.0, 1.0, seed=0, k=64)
    # a context that does not fit by itself is refused before its forward, with what it needs:
    # 40 positions x 256 bytes of keys and values, and 4 x 40 x 256 (the MLP's width) x 4 bytes
    fresh = Decoder(load_teacher(saved["qwen3"], "float32", torch.device("cpu")), [END], 0)
    with pytest.raises(SpdsError, match=r"the context's 40 positions need about 0.0 GiB .* GiB free"):
        fresh.answer(batch, 12, temperature=0.0, top_p=1.0, seed=0)


def test_sampling_is_the_same_for_a_seed_and_the_prefix_is_the_batchs_own(saved):
    model = load_teacher(saved["qwen3"], "float32", torch.device("cpu"))
    batch = prompts(torch.Generator().manual_seed(5))
    first = Decoder(model, [END], 0).answer(batch, 16, temperature=1.0, top_p=0.9, seed=7)
    second = Decoder(model, [END], 0).answer(batch, 16, temperature=1.0, top_p=0.9, seed=7)
    other = Decoder(model, [END], 0).answer(batch, 16, temperature=1.0, top_p=0.9, seed=8)
    assert first == second and first != other
    assert all(a[-1] == END and END not in a[:-1] for a in first)  # every answer ends once, at its end
    assert common_prefix(batch) == 40 and common_prefix([[3, 4], [3, 4]]) == 1  # each keeps its last token


def test_a_sampled_token_is_torch_multinomials_draw():
    """pick samples without torch.multinomial's checks (two passes over the floats a step), and
    draws what it would draw: the same generator, consumed the same way, gives the same tokens,
    step after step (a nucleus included)."""
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(0)) * 4
    for temperature, top_p in [(1.0, 1.0), (0.7, 1.0), (1.0, 0.9)]:
        ours, theirs = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        probabilities = torch.softmax(logits / temperature, dim=-1)
        if top_p < 1:  # the nucleus, as transformers' TopPLogitsWarper keeps it
            ordered, order = probabilities.sort(dim=-1, descending=True)
            kept = ordered.cumsum(dim=-1) - ordered < top_p
            probabilities = torch.zeros_like(probabilities).scatter_(-1, order, ordered * kept)
        for _ in range(3):
            expected = torch.multinomial(probabilities, 1, generator=theirs)[:, 0]
            assert torch.equal(pick(logits, temperature, top_p, ours)[0], expected)


def test_each_prompt_samples_at_its_own_temperature(saved):
    """A list of temperatures: a prompt at 0 gets its greedy answer, and the others the answers
    they get when the whole batch samples at theirs (the random numbers are drawn for every row)."""
    model = load_teacher(saved["qwen3"], "float32", torch.device("cpu"))
    batch = prompts(torch.Generator().manual_seed(5))
    mixed = Decoder(model, [END], 0).answer(batch, 16, temperature=[0.0, 1.0, 0.0, 1.0], top_p=1.0, seed=7)
    greedy = Decoder(model, [END], 0).answer(batch, 16, temperature=0.0, top_p=1.0, seed=7)
    sampled = Decoder(model, [END], 0).answer(batch, 16, temperature=1.0, top_p=1.0, seed=7)
    assert greedy != sampled
    assert mixed == [greedy[0], sampled[1], greedy[2], sampled[3]]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_that_are_not_finite_stop_the_batch_with_a_message(saved, temperature):
    model = load_teacher(saved["qwen3"], "float32", torch.device("cpu"))
    with torch.no_grad():
        model.lm_head.weight[5] = float("nan")  # one token's logit NaN: softmax makes every probability NaN
    batch = prompts(torch.Generator().manual_seed(5))
    with pytest.raises(SpdsError, match="logits are not finite"):
        Decoder(model, [END], 0).answer(batch, 4, temperature=temperature, top_p=1.0, seed=7)


@pytest.mark.numeric  # rerun under ATEN_CPU_CAPABILITY avx2 and default (make test): other CPUs' kernels
@pytest.mark.parametrize("flash", ["as this CPU runs it", "refused"])
def test_the_demos_bf16_teacher_decodes_on_any_cpu(tiny_assets, flash, monkeypatch, capsys):
    """The demo's teacher (bf16, head dimension 16, a context of hundreds of tokens): PyTorch's CPU
    flash kernel for such a bf16 attention stops on some CPUs ("pack_vnni2 is only supported when
    avx512 is supported": an Intel Xeon with AMX under ATEN_CPU_CAPABILITY=avx2). The decoder's
    prefill calls it where it runs, and where it refuses (here: the kernel raising that error, as
    PyTorch raises it) runs plain sums instead and says so once. Either way its greedy answers
    start as transformers' generate of the same weights starts them."""
    import spds.kernels.shared_keys as shared_keys

    monkeypatch.setattr(shared_keys, "CPU_FLASH_REFUSED", set())
    if flash == "refused":

        def refusing(*args, **kwargs):
            raise RuntimeError("pack_vnni2 is only supported when avx512 is supported")

        monkeypatch.setattr(shared_keys, "cpu_flash_kernel", refusing)
    model = load_teacher(tiny_assets / "student", "bfloat16", torch.device("cpu"))
    # the reference in transformers' eager attention: no spds code between it and the weights
    student = tiny_assets / "student"
    plain = AutoModelForCausalLM.from_pretrained(student, dtype=torch.bfloat16, attn_implementation="eager")
    batch = prompts(torch.Generator().manual_seed(6), context=300, vocab=model.config.vocab_size)
    answers = Decoder(model, [END], 0).answer(batch, 8, temperature=0.0, top_p=1.0, seed=0)
    assert all(a[-1] == END and END not in a[:-1] for a in answers)
    # bf16 rounds the logits to 8 bits, so another summation order may flip a later near-tie: the
    # first answer token, after identical prompts, is compared; the rest need only be well formed
    assert [a[0] for a in answers] == [reference_greedy(plain, p, 8)[0] for p in batch]
    said = capsys.readouterr().err
    assert ("refuses bfloat16 on this CPU (pack_vnni2" in said) == (flash == "refused")
    assert said.count("refuses bfloat16") <= 1  # probed once, said once


@pytest.mark.parametrize(
    "student, refusal",
    [
        ({"attention_kernel": "fa4"}, "student.attention_kernel names fa4 (FlashAttention-4), but there is no CUDA"),
        ({"liger_kernels": True}, "student.liger_kernels is true but liger-kernel is not importable or there is no"),
    ],
)
def test_generate_runs_the_kernels_the_student_names_or_refuses(tiny, student, refusal):
    """The teacher decodes on the kernels training would run (student.attention_kernel's fa4 for the
    shared part, student.liger_kernels), and a kernel that cannot run here stops generate before
    any row is written, naming the setting, as it stops training."""
    from conftest import edit_config

    from spds.contract.gate import load_config
    from spds.generation.generate import generate

    (tiny / "questions.jsonl").write_text('{"question_id": "q0", "question": "Where is the archive?"}\n')
    edit_config(tiny, student=student, context={"text": "The archive is in Lumen Bay."})
    edit_config(tiny, generate={"questions": "questions.jsonl", "output": "rows.jsonl"})
    with pytest.raises(SpdsError) as refused:
        generate(load_config(tiny / "config.json"), log=lambda *_: None)
    assert refusal in str(refused.value)
    assert not (tiny / "rows.jsonl").exists() or not (tiny / "rows.jsonl").read_text()


def test_given_answers_scored_in_groups_each_of_its_own_length(saved, monkeypatch):
    """Decoder.score splits the answers into groups whose logits fit SCORE_LOGITS_BYTES. A group
    whose answers are all shorter than the longest of the whole call must keep its own longest's
    logits: with a published vocabulary (151,936 rows) a group holds a few recitals, and a group of
    short ones once failed on keeping more logits than its rows have."""
    import spds.generation.decode

    model = load_teacher(saved["qwen3"], "float32", torch.device("cpu"))
    plain = AutoModelForCausalLM.from_pretrained(saved["qwen3"], dtype=torch.float32, attn_implementation="eager")
    generator = torch.Generator().manual_seed(5)
    batch = prompts(generator)
    answers = [torch.randint(2, 300, (n,), generator=generator).tolist() + [END] for n in (14, 2, 3, 1)]
    per_row = 15 * model.config.vocab_size * 4  # the longest answer's logits: two rows a group
    monkeypatch.setattr(spds.generation.decode, "SCORE_LOGITS_BYTES", 2 * per_row)
    tops = Decoder(model, [END], pad_id=0).score(batch, answers, k=4)
    assert_top_k_of_plain_forward(plain, batch, answers, tops, "qwen3")


def test_the_output_layers_padded_rows_are_never_picked_nor_listed(tmp_path):
    """A published checkpoint's output layer is wider than its tokenizer (Qwen3: 151,936 rows for
    151,669 ids). With `vocabulary` the tokenizer's size, the decoder never samples, scores or lists
    a padded row, even where the padded rows' logits are the largest (a random-weight model's
    are as large as any), and its top-k log-probabilities are a softmax over the real ids alone:
    the plain forward's logits cut to the first `vocabulary` columns, log-softmaxed."""
    real, padded = 300, 320
    directory = save_family(tmp_path / "qwen3", "qwen3", vocab_size=padded)
    model = load_teacher(directory, "float32", torch.device("cpu"))
    with torch.no_grad():  # padding rows that would win every pick
        model.lm_head.weight[real:] = model.lm_head.weight[:real].abs().max() * 4 * model.lm_head.weight[real:].sign()
    plain = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    plain.lm_head.weight.data.copy_(model.lm_head.weight.data)
    batch = prompts(torch.Generator().manual_seed(2), vocab=real)
    unmasked = Decoder(model, [END], pad_id=0).answer(batch, 6, temperature=1.0, top_p=1.0, seed=0)
    assert any(t >= real for answer in unmasked for t in answer)  # the test's premise: padding would be drawn
    decoder = Decoder(model, [END], pad_id=0, vocabulary=real)
    for temperature in (0.0, 1.0):
        answers, tops = decoder.answer_with_top_k(batch, 6, temperature, 1.0, seed=0, k=4)
        assert all(t < real for answer in answers for t in answer)
        for prompt, answer, top in zip(batch, answers, tops):
            with torch.no_grad():
                logits = plain(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1, :real]
            expected = torch.log_softmax(logits, dim=-1).topk(4, dim=-1)
            assert top["ids"] == expected.indices.tolist()
            # fp32: the two-part softmax and another order of sums (~1e-6, as above)
            assert (torch.tensor(top["logprobs"]) - expected.values).abs().max() < 1e-4
    scored = decoder.score(batch, answers, k=4)
    assert [s["ids"] for s in scored] == [t["ids"] for t in tops]


@pytest.mark.numeric
@pytest.mark.parametrize("splits", [2, 3, 5])
def test_the_shared_keys_in_runs_give_one_passes_attention(splits):
    """A decode step's shared part cut into runs of keys (split-KV; 37 keys: a remainder run too),
    merged by log-sum-exps, against one pass over all of them. fp32: the regrouped softmax changes
    the order of a few sums (~1e-7 relative), nothing near a key missed or counted twice."""
    from spds.kernels.shared_keys import attend, attend_split

    generator = torch.Generator().manual_seed(splits)
    query, key, value = (torch.randn(1, 2, n, 16, generator=generator) for n in (5, 37, 37))
    output, lse = attend_split(query, key, value, 0.25, splits)
    expected, expected_lse = attend(query, key, value, scale=0.25)
    assert (output - expected).abs().max() < 1e-5 and (lse - expected_lse).abs().max() < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_batch_of_several_prefixes_answers_each_row_as_among_its_prefixs_rows_alone(saved, family):
    """Eval's views, the eval questions' slices and self-study over small slices fill one batch
    with rows of several prefixes (Decoder.answer_with_top_k's `shared_within` list and
    `prefix_of`): each row reads its own prefix's keys and values. fp32 on the CPU: the greedy
    answers of every row are the ids it gets decoded among its own prefix's rows alone and
    transformers' own generate's, and the top-k log-probabilities agree to fp32 rounding (the
    batch's shapes change the order of a few sums). The windowed families (the Gemmas) decode
    each prefix alone inside the call: the same promise."""
    model = load_teacher(saved[family], "float32", torch.device("cpu"))
    plain = load_teacher(saved[family], "float32", torch.device("cpu"))
    generator = torch.Generator().manual_seed(11)
    # three prefixes of different lengths (a corpus's slices), their questions interleaved
    opened = [prompts(generator, context=n)[1:3] for n in (30, 40, 52)]  # questions of 1 and 9 tokens
    batch = [opened[p][q] for q in range(2) for p in range(3)]
    within = [30, 40, 52] * 2
    decoder = Decoder(model, [END], pad_id=0)
    answers, tops = decoder.answer_with_top_k(batch, 8, 0.0, 1.0, 0, 4, shared_within=within)
    assert decoder.prefix_forwards == 3  # each prefix once
    for p, n in enumerate((30, 40, 52)):
        alone, alone_tops = Decoder(model, [END], pad_id=0).answer_with_top_k(opened[p], 8, 0.0, 1.0, 0, 4, None, n)
        assert answers[p::3] == alone == [reference_greedy(plain, q, 8) for q in opened[p]], (family, p)
        for mine, own in zip(tops[p::3], alone_tops):
            assert mine["ids"] == own["ids"]
            torch.testing.assert_close(torch.tensor(mine["logprobs"]), torch.tensor(own["logprobs"]))
    # prefixes given as input embeddings (eval's views: the header and what goes where the prompt goes)
    embed = model.get_input_embeddings()
    heads = [embed(torch.tensor(opened[p][0][:n])) for p, n in enumerate((30, 40, 52))]
    asked = [q[n:] for q, n in zip(batch, within)]
    together = Decoder(model, [END], pad_id=0).answer_with_top_k(
        asked, 8, 0.0, 1.0, 0, 0, prefix_embeds=heads, prefix_of=[0, 1, 2] * 2
    )[0]
    for p in range(3):
        alone = Decoder(model, [END], pad_id=0).answer_with_top_k(asked[p::3], 8, 0.0, 1.0, 0, 0, heads[p])[0]
        assert together[p::3] == alone == answers[p::3], (family, p)
