"""#67 item 2: a LoRA push's merge is complete before the sender reads any tensor, and undone only after it read the
last (trainer.gpu.push_path.merge_before_push). TRL 1.16 merges on the first item its iterator yields and unmerges
when it is exhausted; vLLM's packed sender reads chunks on two side streams that do not wait for each other, so on a
GPU nothing ordered the merge before later chunks, nor the unmerge after the last chunk's packing. On the CPU the order
is observed directly: what the sender sees when it is handed the iterator and after it has read every tensor. The
sender is a stand-in for vLLM's (test double, no NCCL)."""

from __future__ import annotations

import copy
import os

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from contract.config import RunConfig  # noqa: E402
from trainer.gpu import push_path  # noqa: E402
from tests.gpu_path.test_push_path import tiny_model, with_lora  # noqa: E402


def merged_flags(model) -> set[bool]:
    from peft.tuners.lora import LoraLayer

    return {bool(m.merged) for m in model.modules() if isinstance(m, LoraLayer)}


class StandInSender:
    """Stands in for TRL's VLLMClient: `update_named_params` is where vLLM's packed sender reads the iterator."""

    def __init__(self, model):
        self.model, self.at_handover, self.after_last, self.received = model, None, None, []

    def update_named_params(self, metadata, named_params):
        self.at_handover = merged_flags(self.model)  # before the sender reads its first tensor
        self.received = [(name, tensor.detach().clone()) for name, tensor in named_params]
        self.after_last = merged_flags(self.model)  # the last chunk is packed after this point

    def reset_prefix_cache(self):
        pass


def test_lora_merge_completes_before_the_first_read_and_unmerges_after_the_last_stand_in_sender():
    import torch

    cfg = RunConfig.load(["--lora-r", "4", "--train-mode", "gpu"])
    model = with_lora(tiny_model(), cfg)
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    reference = dict(copy.deepcopy(model).merge_and_unload().named_parameters())
    sender = StandInSender(model)
    gen = push_path.generation(model, None, client=sender)  # push_path.install's hooks, as training's
    gen.sync_weights()

    assert sender.at_handover == {True}, "the adapter must be merged before the sender reads the first tensor"
    assert sender.after_last == {True}, "the adapter must stay merged until the sender has read the last tensor"
    assert merged_flags(model) == {False}  # unmerged once the push returned
    # the trained weights are back (merge then unmerge in fp32 rounds, as TRL's own push does)
    assert all(torch.allclose(p, base[n], rtol=0, atol=1e-6) for n, p in model.named_parameters())
    names = [n for n, _ in sender.received]
    assert names == [n for n in reference if n != "lm_head.weight" or n in names]
    assert all(torch.equal(t, reference[n]) for n, t in sender.received)  # merged weights, every one
    gen.sync_weights()  # a second push: the same order again
    assert sender.at_handover == sender.after_last == {True} and merged_flags(model) == {False}


def test_a_model_without_an_adapter_is_left_as_trl_pushes_it():
    sender = StandInSender(tiny_model())
    gen = push_path.generation(sender.model, None, client=sender)
    assert not getattr(gen.sync_weights, "_grpo_merge_ordered", False)
    gen.sync_weights()
    assert len(sender.received) == len(dict(sender.model.named_parameters()))
