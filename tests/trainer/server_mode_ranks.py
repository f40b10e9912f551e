"""`trainer.train` with TRL's vLLM server-mode generation collective, the vLLM server replaced by a script.

Test double for a GPU-only step (tests/trainer/test_ranks_in_step.py launches it on 2 CPU processes):
every generation goes through TRL's own `VLLMGeneration.generate` in server mode, so each call is the real
collective (`gather_object` of every rank's prompts, rank 0 asks the "server", `broadcast_object_list`, each
rank keeps the slice `process_index * len(prompts)`); only the server answering is a script. The script makes
each echo prompt's word decide how many tool rounds its rollout needs, so ranks differ in rounds and in
prompt counts per round. Each rank writes what its rollouts got to RANK_LOG_DIR/rank<N>.jsonl.

    accelerate launch --num_processes 2 ... tests/trainer/server_mode_ranks.py [trainer.train flags]
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

ROUNDS = {"apple": 0, "river": 1, "green": 2, "music": 3, "cloud": 1, "stone": 2}  # tool turns per word


class ScriptedServer:
    """Answers `VLLMClient.generate` as the vLLM server would, from a script instead of a model."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def turn(self, prompt_ids: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt_ids)
        word = re.search(r"say the word: (\w+)", text).group(1)
        done = text.count("<|im_start|>assistant") - 1  # assistant turns already in the prompt
        if done < ROUNDS[word]:
            out = '<tool_call>\n{"name": "echo_message", "arguments": {"message": "%s"}}\n</tool_call>' % word
        else:
            out = f"Done {word}."
        return self.tokenizer.encode(out, add_special_tokens=False) + [self.tokenizer.eos_token_id]

    def generate(self, prompts, features=None, n=1, **sampling) -> dict:
        return {"prompt_ids": prompts, "completion_ids": [self.turn(p) for p in prompts for _ in range(n)],
                "logprobs": None}


def server_mode_generation(trainer):
    from trl.generation.vllm_generation import VLLMGeneration

    generation = object.__new__(VLLMGeneration)  # no server to connect to: set what generate() reads
    generation.__dict__.update(
        accelerator=trainer.accelerator, mode="server", vllm_client=ScriptedServer(trainer.processing_class),
        temperature=1.0, top_p=1.0, top_k=-1, min_p=None, repetition_penalty=1.0, enable_sleep_mode=False,
        max_completion_length=trainer.max_completion_length, logprobs=0, structured_outputs_regex=None,
        generation_kwargs={})
    return generation


def main() -> int:
    from trl import GRPOTrainer

    import trainer.run.grpo_trainer as grpo_trainer
    import trainer.train as train

    log_dir = Path(os.environ["RANK_LOG_DIR"])

    def generate(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        if "_server_double" not in self.__dict__:
            self._server_double = server_mode_generation(self)
        _, completion_ids, _, _ = self._server_double.generate(prompts=prompt_ids, images=None,
                                                                num_generations=num_generations)
        self._generations = getattr(self, "_generations", 0) + 1
        return completion_ids, None

    GRPOTrainer._generate_single_turn = generate
    make_trainer_class = grpo_trainer.make_trainer_class

    def make_logged_trainer_class():
        class Logged(make_trainer_class()):
            def _tool_call_loop(self, prompts, *rest):
                self._generations = 0
                out = super()._tool_call_loop(prompts, *rest)
                completions = out[1]
                words = [re.search(r"say the word: (\w+)", json.dumps(p)).group(1) for p in prompts]
                record = {
                    "step": self.state.global_step,
                    "words": words,
                    "tool_rounds_needed": max(sum(m["role"] == "tool" for m in c) for c in completions),
                    "tool_calling": sum(bool(c[0].get("tool_calls")) for c in completions),
                    "generations": self._generations,
                    # every assistant turn of rollout i must be about rollout i's own word
                    "foreign_turns": sum(w not in json.dumps(m) for w, c in zip(words, completions)
                                         for m in c if m["role"] == "assistant"),
                }
                with open(log_dir / f"rank{self.accelerator.process_index}.jsonl", "a") as fh:
                    fh.write(json.dumps(record) + "\n")
                return out
        return Logged

    grpo_trainer.make_trainer_class = make_logged_trainer_class
    return train.main(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
