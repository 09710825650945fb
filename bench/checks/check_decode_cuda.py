"""spds generate's decoding on CUDA, where its kernels differ from the CPU's (cuDNN, flash and
memory-efficient attention with their log-sum-exps, FlashAttention-4's shared part where it
imports, the Triton merge of the shared and own parts, the captured CUDA-graph step): every
step's logits against transformers' own eager forward over the whole prompt and answer so far,
for each decoder family of tests/fixtures/models/families.json (tiny shapes; Gemma's windows of
8 end inside the shared prefix). The CPU suite runs the same comparison (tests/test_decode.py)
on PyTorch's math.

    python bench/check.py decode_cuda        (exits 1 when a family's logits stray)
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import spds.generation.decode
from spds.generation.decode import BatchCache, Decoder, pick
from spds.generation.generate import load_teacher
from spds.kernels.shared_keys import own_keys_step

FAMILIES = {k: v for k, v in json.loads(Path("tests/fixtures/models/families.json").read_text()).items() if k[0] != "_"}
END, VOCAB = 1, 300
torch.backends.cuda.matmul.allow_tf32 = False  # the reference in full fp32


def check_pick() -> list:
    """The decoder's sampling (decode.pick: torch.multinomial's exponential race without its host
    sync) against torch.multinomial itself on CUDA, at a real vocabulary and many rows: the same
    generator gives the same tokens, step after step; and the time of one pick against
    softmax and multinomial's (with its checks: two more passes over the floats)."""
    failed = []
    logits = torch.randn(256, 151936, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 4
    ours, theirs = torch.Generator("cuda").manual_seed(1), torch.Generator("cuda").manual_seed(1)
    for step in range(4):
        expected = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=theirs)[:, 0]
        if not torch.equal(pick(logits, 1.0, 1.0, ours)[0], expected):
            failed.append(("pick", step))
    seconds = {}
    for name, run in [
        ("multinomial", lambda: torch.multinomial(torch.softmax(logits / 1.0, dim=-1), 1, generator=theirs)),
        ("pick", lambda: pick(logits, 1.0, 1.0, ours)),
    ]:
        run()
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(100):
            run()
        torch.cuda.synchronize()
        seconds[name] = round((time.perf_counter() - began) * 10, 4)  # ms a call
    print(json.dumps(dict(pick_equals_multinomial=not failed, ms_per_call_256x151936=seconds)))
    return failed


def check_own_keys() -> list:
    """The decode step's attention over each row's own keys (shared_keys.own_keys_step, bf16) against
    plain fp64 attention (written out here) over the same keys under an explicit mask: holes before each row's keys,
    unwritten positions after, several blocks of keys, windows inside one block and across blocks;
    head sizes a power of 2 and not (Phi-3's 96), 1 to 4 query heads per key/value head."""
    failed = []
    torch.manual_seed(0)
    rows, kv, capacity = 6, 2, 304
    for dim, groups in ((64, 4), (96, 3), (128, 2), (128, 1)):
        for window in (None, 5, 70):
            cache = BatchCache(1, rows, capacity, torch.device("cuda"))
            holes = [0, 3, 1, 7, 0, 2]
            cache.skip_holes(holes)
            written_to = 200  # every row has written up to index 200 (the query's own key included)
            cache.index = torch.arange(0, written_to + 1, device="cuda")
            key = torch.randn(rows, kv, written_to + 1, dim, device="cuda", dtype=torch.bfloat16)
            value = torch.randn_like(key)
            cache.update(key, value, 0)
            cache.written = (written_to + 1 - cache.own_from).to(torch.int32)
            query = torch.randn(rows, kv * groups, 1, dim, device="cuda", dtype=torch.bfloat16)
            keys, values = cache.keys[0], cache.values[0]
            output, lse = own_keys_step(query, keys, values, cache.own_from, cache.written, dim**-0.5, window)
            output, lse = output.reshape(query.shape), lse.reshape(rows, kv * groups, 1)
            index = torch.arange(cache.capacity, device="cuda")
            visible = (index >= cache.own_from[:, None]) & (index <= written_to)
            if window:
                visible &= written_to - index < window
            mask = visible[:, None, None, :]  # [rows, 1, 1, keys], the same for every head
            keys = keys.transpose(1, 2).repeat_interleave(groups, dim=1)
            values = values.transpose(1, 2).repeat_interleave(groups, dim=1)
            # the reference in plain PyTorch (fp64), nothing of spds's attention
            scores = (query.double() @ keys.double().transpose(-1, -2)) * dim**-0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            expected_lse = torch.logsumexp(scores, dim=-1)
            expected = (torch.softmax(scores, dim=-1) @ values.double()).float()
            worst = (output.float() - expected).abs().max().item()
            worst_lse = (lse.double() - expected_lse).abs().max().item()
            # bf16 outputs of values ~N(0, 1): their rounding is under 1e-2; a key read wrongly moves them ~0.1
            print(
                json.dumps(
                    dict(
                        check="own_keys_step",
                        dim=dim,
                        groups=groups,
                        window=window,
                        worst_output=worst,
                        worst_lse=worst_lse,
                    )
                )
            )
            if not (worst < 2e-2 and worst_lse < 1e-2):
                failed.append(("own_keys_step", dim, groups, window))
    return failed


def fa4_imports() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return True


def main(args) -> int:
    generator = torch.Generator().manual_seed(4)
    shared = torch.randint(2, VOCAB, (40,), generator=generator).tolist()
    batch = [shared + torch.randint(2, VOCAB, (n,), generator=generator).tolist() for n in (5, 1, 9, 3)]
    failed = check_own_keys() + check_pick()
    with tempfile.TemporaryDirectory() as root:
        for family, entry in FAMILIES.items():
            fields = dict(entry["config"])
            config = AutoConfig.for_model(
                fields.pop("model_type"),
                vocab_size=VOCAB,
                eos_token_id=END,
                pad_token_id=0,
                bos_token_id=None,
                initializer_range=0.2,
                **fields,
            )
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config).save_pretrained(Path(root) / family)
            plain = AutoModelForCausalLM.from_pretrained(
                Path(root) / family, dtype=torch.float32, attn_implementation="eager"
            ).cuda()
            plain16 = AutoModelForCausalLM.from_pretrained(
                Path(root) / family, dtype=torch.bfloat16, attn_implementation="eager"
            ).cuda()
            runs = [("float32", False), ("bfloat16", False)] + ([("bfloat16", True)] if fa4_imports() else [])
            for dtype, fa4 in runs:
                model = load_teacher(Path(root) / family, dtype, torch.device("cuda"))
                seen = []  # each step's logits, copied: a graph's output buffer is overwritten by the next step
                spds.generation.decode.pick = lambda logits, *a: seen.append(logits.clone()) or pick(logits, *a)
                decoder = Decoder(model, [END], pad_id=0, fa4=fa4)
                answers = decoder.answer(batch, 12, temperature=0.0, top_p=1.0, seed=0)
                worst = theirs = 0.0
                for row, (prompt, answer) in enumerate(zip(batch, answers)):
                    picked = answer[: len(seen)]
                    with torch.no_grad():
                        whole = torch.tensor([prompt + picked[:-1]], device="cuda")
                        reference = plain(whole).logits[0, len(prompt) - 1 :]
                        transformers16 = plain16(whole).logits[0, len(prompt) - 1 :].float()
                    theirs = max(theirs, (transformers16 - reference).abs().max().item())
                    for step in range(len(picked)):
                        worst = max(worst, (seen[step][row] - reference[step].float()).abs().max().item())
                # fp32: sums in another order (1e-6); bf16: rounding in every layer, as transformers'
                # own bf16 forward of the same sequences has it (its distance from fp32 is the yardstick)
                bound = 1e-3 if dtype == "float32" else 2 * theirs + 0.05
                print(
                    json.dumps(
                        dict(
                            family=family,
                            dtype=dtype,
                            shared_part="fa4" if fa4 else "default",
                            worst_logit_difference=round(worst, 6),
                            bound=round(bound, 6),
                            transformers_bf16_difference=round(theirs, 6),
                            graph_batches=decoder.captured,
                        )
                    )
                )
                if not worst < bound:
                    failed.append((family, dtype, fa4))
    print("FAILED" if failed else "ALL WITHIN BOUNDS", failed)
    return 1 if failed else 0
