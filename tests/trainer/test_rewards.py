"""The unfinished-episode penalty: which completions it charges, and which ids end a completion."""

from __future__ import annotations

from types import SimpleNamespace

from trl.trainer.utils import get_callable_name

from trainer.rollouts.rewards import stop_token_ids, unfinished_penalty


def test_only_a_completion_that_does_not_end_in_a_stop_token_is_charged():
    unfinished = unfinished_penalty(0.5, frozenset({7, 0}))
    assert unfinished(completion_ids=[[3, 4, 7], [3, 4, 5], [3, 0], []]) == [0.0, -0.5, 0.0, 0.0]
    assert get_callable_name(unfinished) == "unfinished"  # TRL logs it as rewards/unfinished/mean
    # an episode the env side ended is not scored (None): TRL leaves it out of the baseline (trainer.rollouts.infra_failures)
    from types import SimpleNamespace

    envs = [SimpleNamespace(_infra_failure=None), SimpleNamespace(_infra_failure="reset failed: no reply")]
    assert unfinished(completion_ids=[[3, 4, 5], [3, 4, 5]], environments=envs) == [-0.5, None]


def test_stop_ids_are_every_eos_the_model_declares_plus_the_tokenizers_eos_and_pad():
    tokenizer = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    listed = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 9]))
    single = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=5))
    assert stop_token_ids(listed, tokenizer) == {0, 2, 9}
    assert stop_token_ids(single, tokenizer) == {0, 2, 5}
    assert stop_token_ids(SimpleNamespace(), tokenizer) == {0, 2}
