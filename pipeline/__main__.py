"""`python -m pipeline [OVERRIDES]` builds a recipe (`recipe=smollm2_xnnpack_8da4w`; with none, the embedded default:
SmolLM2-135M-Instruct on XNNPACK); `-m` runs a Hydra multirun sweep; `--cfg job` prints the composed config.
`python -m pipeline COMMAND [ARGS]` runs one of pipeline/commands (`python -m pipeline commands` lists them).
"""
import sys

from pipeline.commands import COMMANDS, run

if __name__ == "__main__":
    if sys.argv[1:2] == ["commands"]:
        print("\n".join(f"{name:18s} {what}" for name, what in COMMANDS.items()))
    elif sys.argv[1:2] and sys.argv[1] in COMMANDS:
        sys.exit(run(sys.argv[1], sys.argv[2:]))
    elif sys.argv[1:2] and sys.argv[1].isidentifier():  # a bare word is no override: a command misspelled
        print(f"error: {sys.argv[1]!r} is no command (commands: {', '.join(COMMANDS)}) and no override "
              "(KEY=VALUE)", file=sys.stderr)
        sys.exit(2)
    else:
        from pipeline.commands.build import main
        main()
