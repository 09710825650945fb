"""spds export --compose: one prompt from prompts exported separately on the same student.
Embeddings are concatenated; a kv prompt's later keys are turned by RoPE to the positions they now
take. The reference is plain transformers and PyTorch: a DynamicCache holding A's keys and values,
then B's with its keys rotated by the RoPE formula written out here (no spds code), and the
student's forward after it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import edit_config
from helpers import FAST, assert_rounding_close, check, spds
from safetensors import safe_open
from safetensors.torch import save_file

from spds.errors import SpdsError


def exported(directory, form: str, length: int) -> tuple:
    edit_config(directory, **FAST)
    edit_config(directory, soft_prompt={**FAST["soft_prompt"], "form": form, "length": length})
    check(spds(["prepare", "config.json"], directory))
    check(spds(["train", "config.json"], directory))
    check(spds(["export", "config.json"], directory))
    path = directory / "run" / "export" / "soft_prompt.safetensors"
    with safe_open(str(path), framework="pt") as handle:
        return path, handle.get_tensor("prompt"), dict(handle.metadata())


def another(path, prompt, metadata, scale: float, length: int | None = None):
    """A second prompt of the same student (another run's, in effect): other values, same metadata."""
    generator = torch.Generator().manual_seed(7)
    shape = list(prompt.shape)
    if length is not None:
        shape[3 if prompt.dim() == 5 else 0] = length
    other = (torch.randn(shape, generator=generator) * scale).contiguous()
    target = path.with_name("other.safetensors")
    save_file(
        {"prompt": other}, str(target), metadata={**metadata, "prompt_length": str(shape[3 if len(shape) == 5 else 0])}
    )
    return target, other


def rope_turn(keys: torch.Tensor, shift: int, theta: float) -> torch.Tensor:
    """keys [..., p, D] rotated by `shift` positions: the RoPE formula (half-split pairs), fp64."""
    dim = keys.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = torch.cat([shift * inv_freq, shift * inv_freq])
    half = keys.shape[-1] // 2
    rotated = torch.cat([-keys[..., half:], keys[..., :half]], dim=-1)
    return (keys.double() * angle.cos() + rotated.double() * angle.sin()).to(keys.dtype)


def test_kv_prompts_compose_into_the_cache_a_plain_reference_builds(tiny):
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from spds.trained.export import load_soft_prompt, past_key_values

    path_a, a, metadata = exported(tiny, "kv", 4)
    path_b, b = another(path_a, a, metadata, scale=float(a.std()), length=3)
    out = tiny / "composed"
    check(spds(["export", "--compose", str(path_a), str(path_b), str(out)], tiny))
    composed, composed_meta = load_soft_prompt(out / "soft_prompt.safetensors")
    assert composed.shape[3] == 7 and composed_meta["prompt_length"] == "7"
    assert torch.equal(composed[:, :, :, :4], a), "the first prompt is taken as it is"
    model_path = json.loads((tiny / "config.json").read_text())["student"]["model_path"]
    student = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    theta = student.config.rope_parameters["rope_theta"]
    assert torch.equal(composed[:, 1, :, 4:], b[:, 1]) and torch.allclose(
        composed[:, 0, :, 4:], rope_turn(b[:, 0], 4, theta), atol=1e-6
    ), "B's keys are turned by A's length, its values untouched"
    # the logits of a question after the composed prompt, against the plain reference's
    insert_at = json.loads(metadata["insert_at"])[0]
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Where?"}], add_generation_prompt=True, return_dict=False
    )
    ids = [int(i) for i in ids]
    with torch.no_grad():
        cache, input_ids = past_key_values(student, composed, ids[:insert_at] + ids[insert_at:], insert_at)
        got = student(input_ids=input_ids[:, cache.get_seq_length() :], past_key_values=cache).logits
        reference = DynamicCache(config=student.config)
        if insert_at:
            student(input_ids=torch.tensor([ids[:insert_at]]), past_key_values=reference, use_cache=True)
        for layer in range(a.shape[0]):
            keys = torch.cat([a[layer, 0], rope_turn(b[layer, 0], 4, theta)], dim=1)[None]
            values = torch.cat([a[layer, 1], b[layer, 1]], dim=1)[None]
            reference.update(keys, values, layer)
        tail = torch.tensor([ids[insert_at:]])
        positions = torch.arange(insert_at + 7, insert_at + 7 + tail.shape[1])[None]
        expected = student(input_ids=tail, past_key_values=reference, position_ids=positions).logits
    assert_rounding_close(got, expected, what="the composed prompt's logits")


def test_embeddings_compose_by_concatenation_and_other_forms_or_students_are_refused(tiny):
    from spds.trained.export import load_soft_prompt

    path_a, a, metadata = exported(tiny, "embeddings", 4)
    path_b, b = another(path_a, a, metadata, scale=0.3)
    out = tiny / "composed"
    check(spds(["export", "--compose", str(path_a), str(path_b), str(out)], tiny))
    composed, _ = load_soft_prompt(out / "soft_prompt.safetensors")
    assert torch.equal(composed, torch.cat([a, b]))
    # composition keeps its inputs: a composed prompt already in OUT, OUT an input's own directory,
    # and one prompt twice (a copy too) are refused before anything is written; --force replaces
    kept = (out / "soft_prompt.safetensors").read_bytes()
    copy = path_a.with_name("copy.safetensors")
    copy.write_bytes(path_a.read_bytes())
    for args, rule in (
        ([path_b, path_a, out], "rule 'an output is not replaced unasked'"),
        ([path_a, path_b, path_a.parent], "rule 'composition keeps its inputs'"),
        ([path_a, copy, tiny / "twice"], "rule 'each prompt once'"),
    ):
        refused = spds(["export", "--compose", *map(str, args)], tiny)
        assert refused.returncode == 1 and rule in refused.stderr, (rule, refused.stderr)
    assert (out / "soft_prompt.safetensors").read_bytes() == kept and not (tiny / "twice").exists()
    check(spds(["export", "--compose", str(path_b), str(path_a), str(out), "--force"], tiny))
    assert torch.equal(load_soft_prompt(out / "soft_prompt.safetensors")[0], torch.cat([b, a]))
    check(spds(["export", "--compose", str(path_a), str(path_b), str(out), "--force"], tiny))
    # eval and sample read the composed file, on records packed for its length
    edit_config(
        tiny, soft_prompt={**FAST["soft_prompt"], "length": 8}, data={"packed_dir": "packed8", "eval_fraction": 0.25}
    )
    check(spds(["prepare", "config.json"], tiny))
    composed_file = str(out / "soft_prompt.safetensors")
    check(spds(["eval", "config.json", "--checkpoint", composed_file], tiny))
    report = json.loads((tiny / "run" / "eval.json").read_text())
    assert report["checkpoint"] == composed_file and report["update"] is None and report["records"] > 0
    check(spds(["sample", "config.json", "--checkpoint", composed_file], tiny))
    refused = spds(["eval", "config.json", "--checkpoint", str(path_a)], tiny)  # 4 positions, records packed for 8
    assert refused.returncode == 1 and "rule 'prompt fits its records'" in refused.stderr, refused.stderr
    stranger = path_a.with_name("stranger.safetensors")
    save_file({"prompt": b}, str(stranger), metadata={**metadata, "student_identity": "another-student"})
    refused = spds(["export", "--compose", str(path_a), str(stranger), str(tiny / "no")], tiny)
    assert refused.returncode == 1 and "student_identity differs" in refused.stderr, refused.stderr
    assert "rule 'composable prompts'" in refused.stderr and not (tiny / "no").exists()
    with pytest.raises(SpdsError, match="form differs"):
        from spds.trained.export import compose

        kv = path_a.with_name("kv.safetensors")
        save_file(
            {"prompt": torch.zeros(2, 2, 2, 4, 16)},
            str(kv),
            metadata={**metadata, "form": "kv", "layers": "2", "kv_heads": "2", "head_dim": "16"},
        )
        compose([path_a, kv], tiny / "no")


def test_a_students_identity_is_its_content_not_its_path(tiny, tiny_assets):
    """Prompts compose for the same student: a byte-identical copy of the model at another path is
    the same student, and a model replaced at the same path is another (a weight file changed)."""
    import shutil

    from spds.contract.gate import load_config
    from spds.trained.export import student_identity

    copy = tiny / "student-copy"
    shutil.copytree(tiny_assets / "student", copy)
    here = student_identity(load_config(tiny / "config.json", check_pins=False))
    edit_config(tiny, student={"model_path": str(copy)})
    assert student_identity(load_config(tiny / "config.json", check_pins=False)) == here
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert student_identity(load_config(tiny / "config.json", check_pins=False)) != here
