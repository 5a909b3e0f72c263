"""The `hf-gradacc` command line: one module per subcommand (``check``, ``bench``, ``plot``), wired by
:mod:`.hf_gradacc_cli`."""
