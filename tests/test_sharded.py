"""How the fsdp backend lays out the student: what a CPU can check of GPU memory behaviour."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

from spds.model.layout import FSDP2Layout


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_fsdp_layers_give_back_their_weights_after_forward(one_rank_group):
    # FSDP keeps a root's weights gathered from forward to backward; if every layer were a root,
    # the whole student would sit gathered on every GPU during forward (an OOM on 2xH200).
    config = Qwen3Config(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    student = Qwen3ForCausalLM(config).requires_grad_(False)
    FSDP2Layout(student, torch.device("cpu"))
    embeddings = torch.randn(1, 5, 32, requires_grad=True)
    hidden = student.base_model(inputs_embeds=embeddings).last_hidden_state
    sharded = [hasattr(layer.mlp.down_proj.weight, "device_mesh") for layer in student.model.layers]
    assert sharded == [True, True, True]  # resharded after forward: only shards are held
    assert not hasattr(student.get_input_embeddings().weight, "device_mesh")  # replicated: spds calls it directly
    hidden.sum().backward()
    assert embeddings.grad.abs().sum() > 0
