"""ZERO_STD_GROUPS=resample in ROLLOUTS=sync: DAPO's dynamic sampling on TRL 1.16's GRPOTrainer (issue 65 item 4).

A generation batch whose groups all scored alike (advantage 0) trains on its informative groups only. `refill` runs
TRL's `_generate_and_score_completions` on the batch; while flat groups are left and fewer than ZERO_STD_RESAMPLE_MAX
(rounded up) extra batches were generated, it generates one more batch of the same shape from prompts drawn afresh
(`draw`: the same on every process) and puts its informative groups in the flat groups' places. Each process swaps its
own rows only (RunConfig.batch_problem keeps every group on one process), so every process keeps its batch's shape;
the swaps are decided from the gathered rewards, which every process holds alike, so all of them generate the same
number of extra batches (generation is a collective in server and colocate modes). Flat groups left after the bound
are trained as with `keep`. Logged: `zero_std/extra_generation`, extra groups generated per group in the batch (0, 1,
2 ... extra batches), and `frac_reward_zero_std` for every batch generated.

What is swapped is TRL's whole per-row output: ids and masks (prompts padded on the left, completions on the right to
the wider of the two batches), advantages (each group's own, computed within its batch), the per-token log-probs and
importance-sampling ratio; the loss's token count (`num_items_in_batch`) is counted again. A batch with images is left
as it is (its per-image tensors are not per row).
"""

from __future__ import annotations

import math
import random
from typing import Callable

from trainer.rollouts import zero_variance

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # padded on the left by TRL; every other per-row tensor on the right
NOT_PER_ROW = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "num_images")


def _pad(tensor, width: int, left: bool, value):
    import torch

    missing = width - tensor.shape[1]
    if missing <= 0:
        return tensor
    pad = torch.full((tensor.shape[0], missing), value, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([pad, tensor] if left else [tensor, pad], dim=1)


def merge_rows(base: dict, extra: dict, pairs: list[tuple[int, int]], pad_token_id: int) -> dict:
    """`base` (TRL's generation output) with row `extra[j]` in place of row `base[i]` for each (i, j)."""
    import torch

    if not pairs:
        return base
    rows = base["completion_ids"].shape[0]
    out = dict(base)
    into = torch.tensor([i for i, _ in pairs])
    take = torch.tensor([j for _, j in pairs])
    for key, value in base.items():
        other = extra.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != rows or other is None:
            continue
        if value.dim() == 2:
            width = max(value.shape[1], other.shape[1])
            fill = pad_token_id if key.endswith("_ids") else 1 if key == "tool_mask" else 0
            left = key in PROMPT_KEYS
            value, other = _pad(value, width, left, fill), _pad(other, width, left, fill)
        value = value.clone()
        value[into.to(value.device)] = other[take.to(other.device)].to(value.dtype)
        out[key] = value
    return out


def draw(trainer, rows: int, extra_round: int) -> list[dict]:
    """A generation batch's worth of fresh prompts for this process (`rows` rows, NUM_GENERATIONS each in a row), drawn
    by an RNG seeded from SEED, the step and the round: the same draw on every process, each taking its own slice."""
    group = trainer.num_generations
    processes, index = trainer.accelerator.num_processes, trainer.accelerator.process_index
    rng = random.Random(f"{trainer.args.seed}:{trainer.state.global_step}:{extra_round}")
    dataset = trainer.train_dataset
    picks = [rng.randrange(len(dataset)) for _ in range(rows * processes // group)]
    mine = picks[index * rows // group:(index + 1) * rows // group]
    return [dict(dataset[i]) for i in mine for _ in range(group)]


def pairs_for(process: int, rows: int, group: int, flat: list[bool], fresh: list[bool], used: set[int]) -> list:
    """(flat group, fresh informative group) pairs within one process's rows, as local group indices. `flat`: the
    batch's global rows still flat; `fresh`: the extra batch's global rows flat; `used`: flat groups already swapped."""
    first = process * rows // group
    count = rows // group
    stale = [g for g in range(count) if flat[(first + g) * group] and g not in used]
    good = [g for g in range(count) if not fresh[(first + g) * group]]
    return list(zip(stale, good))


def refill(trainer, inputs: list[dict], one_round: Callable[[list[dict]], dict]) -> dict:
    """`one_round(inputs)` (TRL's generation and scoring, with the stack's masking), refilled as the module says."""
    output = one_round(inputs)
    flat = getattr(trainer, "_flat_rows", None)
    if (getattr(trainer, "zero_std_groups", "keep") != "resample" or not trainer.model.training or not flat
            or not any(flat) or any(key in output for key in NOT_PER_ROW)):
        return output
    group, rows = trainer.num_generations, len(inputs)
    processes, me = trainer.accelerator.num_processes, trainer.accelerator.process_index
    flat = list(flat)
    used: dict[int, set[int]] = {p: set() for p in range(processes)}
    rounds = 0
    while any(flat) and rounds < math.ceil(trainer.zero_std_resample_max):
        rounds += 1
        extra = one_round(draw(trainer, rows, rounds))
        fresh = getattr(trainer, "_flat_rows", None) or [False] * len(flat)
        for process in range(processes):
            pairs = pairs_for(process, rows, group, flat, fresh, used[process])
            for stale, _ in pairs:
                used[process].add(stale)
                for r in range(group):
                    flat[(process * rows // group + stale) * group + r] = False
            if process == me:
                row_pairs = [(s * group + r, g * group + r) for s, g in pairs for r in range(group)]
                output = merge_rows(output, extra, row_pairs, trainer.processing_class.pad_token_id)
    mask = output["completion_mask"] if output.get("tool_mask") is None \
        else output["completion_mask"] * output["tool_mask"]
    output["num_items_in_batch"] = trainer.accelerator.gather(mask.sum()).sum()
    trainer._metrics["train"][zero_variance.EXTRA_GENERATION].append(float(rounds))
    trainer._flat_rows = None
    return output
