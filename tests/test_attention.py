"""spds's attention function: the flex kernel's block mask, its numbers, and the kernel a
checkpointed layer recomputes with. References are plain transformers forwards and masks
computed element by element with numpy."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from conftest import make_tiny
from helpers import assert_matches_reference, assert_rounding_close
from helpers import spliced_reference_loss as reference_loss

from spds.contract.gate import section
from spds.kernels import attention, causal
from spds.model.loss import make_loss
from spds.model.soft_prompt import Segment, SoftPromptModel
from spds.model.student import initial_prompt

# a tiny Qwen3 shape with grouped-query heads (4 query heads, 2 key/value heads)
TINY_QWEN3 = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)
BLOCK = causal.BLOCK


def block_sets(mask) -> tuple[set, set]:
    """(partial, full) as sets of (query tile, key block) from a BlockMask's indices."""

    def read(counts, indices):
        counts, indices = counts[0, 0].tolist(), indices[0, 0].tolist()
        return {(row, indices[row][i]) for row in range(len(counts)) for i in range(counts[row])}

    return read(mask.kv_num_blocks, mask.kv_indices), read(mask.full_kv_num_blocks, mask.full_kv_indices)


@pytest.mark.parametrize(
    "queries,keys",
    [
        (1, 1),
        (5, 5),
        (128, 128),
        (130, 130),
        (300, 300),
        (100, 400),
        (257, 1000),
        (128, 256),
        (1000, 1000),
        (129, 4000),
    ],
)
def test_causal_block_mask_covers_exactly_the_allowed_pairs(queries, keys):
    allowed = np.arange(keys)[None] <= np.arange(queries)[:, None] + (keys - queries)  # element by element
    assert_visits_exactly(causal.causal_block_mask(queries, keys, torch.device("cpu")), allowed)


def assert_visits_exactly(mask, allowed: np.ndarray) -> None:
    """Every block with an allowed pair is visited; a block skips the mask only when whole and all allowed."""
    partial, full = block_sets(mask)
    assert not partial & full
    queries, keys = allowed.shape
    for row in range(-(-queries // BLOCK)):
        for column in range(-(-keys // BLOCK)):
            tile = allowed[row * BLOCK : (row + 1) * BLOCK, column * BLOCK : (column + 1) * BLOCK]
            assert ((row, column) in partial | full) == bool(tile.any()), (row, column)
            if (row, column) in full:
                assert tile.shape[1] == BLOCK and tile.all(), (row, column)


@pytest.mark.numeric
@pytest.mark.parametrize("kernel", ["flex", "math", {"below": 20, "short": "math", "long": "flex"}])
def test_each_kernel_gives_the_plain_forwards_loss_and_gradient(tiny_assets, kernel):
    from transformers import AutoModelForCausalLM

    path = tiny_assets / "student"
    student = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).requires_grad_(False)
    rows = [r for r in make_tiny.synthetic_rows(make_tiny.chatml_tokenizer(), 4) if "input_ids" in r]
    segment = Segment(ids=torch.tensor(rows[0]["input_ids"]), prefix_tokens=rows[0]["prefix_tokens"], insert_at=3)
    prompt = initial_prompt(student, section("soft_prompt", length=4, init={"method": "random_normal", "std": 0.5}), 1)
    model = SoftPromptModel(
        student, prompt, make_loss(section("loss", kernel="chunked", chunk_tokens=16)), attention_kernel=kernel
    )
    reference_prompt = prompt.clone().requires_grad_()
    expected = reference_loss(plain, reference_prompt, segment)
    if "flex" in attention.kernels_in(kernel):  # torch has no flex backward on the CPU: the loss only
        with torch.no_grad():
            assert_rounding_close(model([segment]), expected, what="loss")
        return  # the gradient: bench/check.py determinism on CUDA, against fp32 math
    loss = model([segment])
    loss.backward()
    expected.backward()
    assert_rounding_close(loss, expected, what="loss")
    assert_rounding_close(model.prompt.grad, reference_prompt.grad, what="prompt gradient")


def test_a_recomputed_layer_runs_the_kernel_of_its_forward(tiny_assets, monkeypatch):
    """Before, the kernel was chosen by a context manager around the forward: a checkpointed
    layer's recompute, in backward, ran PyTorch's default kernel instead."""
    from spds.model.student import load_student

    used = []  # (kernel, during backward) per attention call
    original = attention.sdpa_causal
    monkeypatch.setattr(
        attention,
        "sdpa_causal",
        lambda kernel, *args: (
            used.append((kernel, torch.is_grad_enabled() and backward_started[0])) or original(kernel, *args)
        ),
    )
    backward_started = [False]
    student = load_student(tiny_assets / "student", "float32", "sdpa", torch.device("cpu"))
    rows = [r for r in make_tiny.synthetic_rows(make_tiny.chatml_tokenizer(), 4) if "input_ids" in r]
    segment = Segment(ids=torch.tensor(rows[0]["input_ids"]), prefix_tokens=rows[0]["prefix_tokens"], insert_at=3)
    prompt = initial_prompt(student, section("soft_prompt", length=4), 1)
    model = SoftPromptModel(
        student,
        prompt,
        make_loss(section("loss", kernel="chunked")),
        activation_checkpointing=True,
        attention_kernel="math",
    )
    loss = model([segment])
    backward_started[0] = True
    loss.backward()
    layers = student.config.num_hidden_layers
    assert [k for k, during in used if not during] == ["math"] * layers
    assert [k for k, during in used if during] == ["math"] * layers  # every layer recomputed, on math


@pytest.mark.parametrize(
    "queries,keys,window",
    [(1, 1, 4), (130, 130, 8), (300, 300, 128), (300, 300, 129), (100, 400, 50), (257, 1000, 300), (1000, 1000, 1000)],
)
def test_windowed_block_mask_covers_exactly_the_allowed_pairs(queries, keys, window):
    """flex's block mask for a sliding-window layer: the window's pairs, element by element."""
    position = np.arange(queries)[:, None] + (keys - queries)
    allowed = (np.arange(keys)[None] <= position) & (np.arange(keys)[None] > position - window)
    assert_visits_exactly(causal.windowed_block_mask(queries, keys, window, torch.device("cpu")), allowed)


@pytest.mark.numeric
def test_a_sliding_window_layer_attends_within_its_window(tiny_assets):
    """A Qwen3 student with sliding-window layers (use_sliding_window): spds's attention gives the
    loss and prompt gradient of transformers' own eager forward, whose mask holds the window."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    shape = dict(TINY_QWEN3, sliding_window=5, max_window_layers=0, initializer_range=0.3)
    config = Qwen3Config(use_sliding_window=True, **shape)
    torch.manual_seed(0)
    student = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").requires_grad_(False)
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="eager").requires_grad_(False)
    plain.load_state_dict(student.state_dict())
    segment = Segment(
        ids=torch.randint(0, 64, (19,), generator=torch.Generator().manual_seed(1)), prefix_tokens=6, insert_at=2
    )
    prompt = torch.randn(3, 32, generator=torch.Generator().manual_seed(2))
    model = SoftPromptModel(student, prompt, make_loss(section("loss", kernel="chunked")), attention_kernel="math")
    expected = assert_matches_reference(model, [segment], lambda p: reference_loss(plain, p, segment), prompt)
    unwindowed = AutoModelForCausalLM.from_config(
        Qwen3Config(use_sliding_window=False, **shape), attn_implementation="eager"
    ).requires_grad_(False)
    unwindowed.load_state_dict(student.state_dict())
    assert abs(float(reference_loss(unwindowed, prompt, segment)) - float(expected)) > 1e-2  # the window binds


def test_deterministic_auto_takes_fa4_only_where_it_runs_and_a_named_fa4_elsewhere_is_refused(monkeypatch):
    """train.deterministic's "auto": FlashAttention-4 where it can run, else flex on CUDA, math on
    the CPU; a config naming fa4 where it cannot run stops with the reason, before any work."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from spds.errors import SpdsError

    student = Qwen3ForCausalLM(Qwen3Config(**TINY_QWEN3, attn_implementation="sdpa"))
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only the device's type is read
    seen = []
    monkeypatch.setattr(attention, "fa4_unavailable", lambda head_dim: seen.append(head_dim) or "not installed")
    assert attention.kernel_setting("auto", True, student, cuda) == "flex"
    assert attention.kernel_setting("auto", True, student, cpu) == "math"
    assert attention.kernel_setting("auto", False, student, cuda) == "auto"
    with pytest.raises(SpdsError, match="names fa4 .FlashAttention-4., but not installed; choose another kernel"):
        attention.kernel_setting({"below": 64, "short": "flash", "long": "fa4"}, True, student, cuda)
    assert seen and set(seen) == {8}  # the student's head dimension is what is checked
    monkeypatch.setattr(attention, "fa4_unavailable", lambda head_dim: None)
    assert attention.kernel_setting("auto", True, student, cuda) == "fa4"
    assert attention.kernel_setting("fa4", False, student, cuda) == "fa4"
    with pytest.raises(SpdsError, match="there is no CUDA device"):
        attention.kernel_setting("fa4", False, student, cpu)


@pytest.mark.parametrize("user_setting", [None, "0"])
def test_fa4_finds_its_disk_cache_switched_on_when_it_is_first_imported(tmp_path, monkeypatch, user_setting):
    """FlashAttention-4 reads FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED once, while flash_attn.cute is
    imported; spds's import must have set it by then, and must leave a user's own value alone.
    A stand-in package records what its import saw (the real one needs a Hopper GPU)."""
    package = tmp_path / "flash_attn" / "cute"
    package.mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("import os\nSEEN = os.environ.get('FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    # set, then delete: monkeypatch then restores each one's absence too, so neither the stand-in
    # modules nor the variable import_fa4 sets outlive this test
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", user_setting or "unset")
    if user_setting is None:
        monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED")
    assert attention.import_fa4().SEEN == (user_setting or "1")


@pytest.mark.numeric
@pytest.mark.parametrize("kernel", ["flex", "auto"])
def test_queries_after_cached_keys_attend_causally_from_the_lower_right(kernel):
    """The teacher's record after its cached context: query i sits at position Lk - Lq + i."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, 8, generator=generator) for h, n in ((4, 5), (2, 12), (2, 12)))
    choice = attention.KernelChoice(kernel)
    module = type("Attention", (), {"spds_kernel": choice})()
    output, _ = attention.causal_attention(module, q, k, v)
    allowed = torch.arange(12)[None] <= torch.arange(5)[:, None] + 7
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 8**0.5
    expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v.repeat_interleave(2, 1)
    assert_rounding_close(output, expected.transpose(1, 2), what="attention output")
