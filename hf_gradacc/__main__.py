"""`python -m hf_gradacc ...` runs the `hf-gradacc` command (see :mod:`hf_gradacc.commands`)."""

from .commands.hf_gradacc_cli import console_main

if __name__ == "__main__":
    raise SystemExit(console_main())
