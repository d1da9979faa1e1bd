"""rlx.trainer.logits_layout on the tiny Qwen3 (CPU, gloo): the hooked output layer's logits
are the very tensor GPTModel returns (no batch-first copy), with the same values, log-probs and
parameter gradients as the unhooked model's through the trainer's log-prob function."""

from __future__ import annotations

import pytest
import torch
from helpers import load_megatron, token_batch

from rlx.config import build
from rlx.config.compose import compose, to_object
from rlx.trainer import context
from rlx.trainer.logits_layout import batch_first_logits


@pytest.fixture(scope="module")
def family(scrambled_dir):
    return build(to_object(compose(["model=tiny_qwen3", f"model.hf_checkpoint={scrambled_dir}"])).model)


def run(model, ids):
    """(logits as GPTModel returns them, what the output layer itself returned, log-probs,
    entropies, parameter gradients) of a weighted loss over both, as the trainer computes it."""
    raw = []
    model.output_layer.register_forward_hook(lambda m, a, out: raw.append(out[0]), prepend=True)
    model.train()
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    logits = model(input_ids=ids, position_ids=positions, attention_mask=None)
    seen = logits.detach().clone()  # the backward writes the gradient over the logits
    logp, entropy = context.next_token_logprobs(logits, ids, temperature=0.8, with_entropy=True)
    weights = torch.linspace(-1.0, 1.0, logp.numel()).view_as(logp)
    ((weights * logp).sum() + (weights.flip(-1) * entropy).sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logits, raw[0], seen, logp.detach(), entropy.detach(), grads


def test_same_numbers_without_the_copy(world, family, scrambled_dir):
    ids = token_batch(seq_len=12)
    plain = load_megatron(family, scrambled_dir)
    hooked = load_megatron(family, scrambled_dir)
    assert batch_first_logits(hooked)
    logits0, raw0, seen0, logp0, ent0, grads0 = run(plain, ids)
    logits1, raw1, seen1, logp1, ent1, grads1 = run(hooked, ids)

    assert raw0.shape == (12, 2, 16) and raw1.shape == (2, 12, 16)  # sequence-first, batch-first
    assert logits0.data_ptr() != raw0.data_ptr()  # GPTModel copied the unhooked layer's output
    assert logits1.data_ptr() == raw1.data_ptr() and logits1.is_contiguous()  # here it did not
    torch.testing.assert_close(seen1, seen0, atol=1e-5, rtol=1e-5)
    assert seen0.std() > 1.0
    torch.testing.assert_close(logp1, logp0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent1, ent0, atol=1e-5, rtol=1e-5)
    assert logp0.shape == (2, 11)
    assert sorted(grads1) == sorted(grads0) and len(grads0) == len(list(plain.parameters()))
    for name, grad in grads0.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads1[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_only_a_vocabulary_output_layer_is_hooked():
    assert not batch_first_logits(torch.nn.Linear(4, 4))  # no output layer
    head = torch.nn.Module()
    head.output_layer = torch.nn.Linear(4, 1)  # the critic's value head
    assert not batch_first_logits(head)
