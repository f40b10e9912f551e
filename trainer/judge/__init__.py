"""The judge (JUDGE_*, contract/config/judge.py; docs/judge.md): a served model that scores episodes beside the env.

One concern a module: `setup` (what a process needs to call it, picklable), `client` (HTTP, failures classified),
`cache` (identical requests answered once), `costs` (per-step figures, the down watch), `transcript` (untrusted text
made data), `rubric` (the template files), `methods` (rubric / ranking / reward_model: requests and replies), `reward`
(TRL's reward function `judge`), `leave_out` (a failed call's row out of the loss and the baseline, and the weights),
`preflight` (the checks before the first step)."""
