"""`python -m contract.config`: print the config read from the environment (`--check`: only validate it; `--names`:
every variable name)."""

from __future__ import annotations

import argparse
import sys

from contract.config.errors import ConfigError
from contract.config.run_config import ENV_VARS, RunConfig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m contract.config",
                                     description="One typed config for a training run: environment variables, then "
                                     "CLI overrides.")
    parser.add_argument("--check", action="store_true", help="validate the environment; exit 1 with the problems")
    parser.add_argument("--names", action="store_true", help="print every variable name, one per line")
    args = parser.parse_args(argv)
    if args.names:
        print("\n".join(ENV_VARS))
    else:
        try:
            cfg = RunConfig.load([])
        except ConfigError as exc:
            print(exc, file=sys.stderr)
            return 1
        if not args.check:
            print(cfg.model_dump_json(indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
