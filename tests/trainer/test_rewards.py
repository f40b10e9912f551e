"""The unfinished-episode penalty: which completions it charges, and which ids end a completion."""

from __future__ import annotations

from types import SimpleNamespace

from trl.trainer.utils import get_callable_name

from trainer.rollouts.rewards import stop_token_ids, unfinished_penalty

TOOL_TURN = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "move"}}]}


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


def test_an_episode_a_budget_ended_on_a_tool_calling_turn_is_charged_and_one_the_model_ended_is_not():
    """The turn that made the calls ends in a stop token, yet the budget ended the episode: its calls never ran (the
    round past the budget or the context rolled back, or the iteration limit reached) or their results got no answer."""
    unfinished = unfinished_penalty(1.0, frozenset({7}))
    answer = {"role": "assistant", "content": "Done."}
    result = {"role": "tool", "name": "move", "content": "ok"}
    episodes = [[answer], [TOOL_TURN, result, answer], [TOOL_TURN], [TOOL_TURN, result, TOOL_TURN], [TOOL_TURN, result]]
    assert unfinished(completion_ids=[[3, 7]] * 5, completions=episodes) == [0.0, 0.0, -1.0, -1.0, -1.0]
    assert unfinished(completion_ids=[[3, 7], [3, 5]], completions=["Done.", "Done"]) == [0.0, -1.0]  # no messages


def test_sync_every_episode_the_loop_ended_by_budget_is_charged_and_only_those(tiny_model_dir, tmp_path):
    """The stack's sync loop on the scripted batch of tests/trainer/test_rollout_loop.py, scored by TRL with the
    penalty: the iteration limit (case 5) and a round rolled back for the budget (case 6) are charged as the turn cut
    at the budget (case 7) is; episodes the model ended itself, after calls or not (cases 0-4), are not."""
    from trl import GRPOTrainer

    from tests.trainer.test_rollout_loop import SCRIPTS, build
    from trainer.rollouts.rollout_loop import make_rollout_loop_class

    scored = []

    class Scoring(make_rollout_loop_class(GRPOTrainer)):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            scored.append(super()._calculate_rewards(inputs, prompts, completions, completion_ids_list))
            return scored[-1]

    def penalty(model, tokenizer):
        return [unfinished_penalty(1.0, stop_token_ids(model, tokenizer))]

    trainer, rows = build(Scoring, tiny_model_dir, tmp_path, [], reward_funcs=penalty)
    trainer._generate_and_score_completions([dict(r) for r in rows for _ in range(2)])  # 2 generations each
    column = scored[0][:, trainer.reward_func_names.index("unfinished")].tolist()
    charged = {case: column[2 * i] for i, case in enumerate(SCRIPTS)}
    assert charged == {0: 0.0, 1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: -1.0, 6: -1.0, 7: -1.0}
